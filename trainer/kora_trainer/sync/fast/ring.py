"""The colocated fast path's ring and delta decision (colocated.py's module docstring).

- `Ring` (Adapter, EngineMerge): each engine's ring of `size` flat buffers, mapped once, and its doorbell word;
  a push gathers the adapter into slot k (`AdapterPack.pack_into`) and names it.
- `Decision` (every mode): the delta decision with no host read of its own on the push's critical path. With one
  trainer rank and a ring, in the slot's gather's own pass against the slot pushed before it (`runs`, kernels/
  gather_delta.py: no copy of the last push kept); else `FlatDelta`; on a GPU one captured CUDA graph per ring slot
  (-1: Merge, the number only).
"""

from __future__ import annotations

from typing import Any

import torch

from kora_trainer.kernels.gather_delta import gather, gather_max_delta, runs_of
from kora_trainer.sync.fast.adapter_pack import AdapterPack, FlatDelta
from kora_trainer.wire.fast_receive import doorbell_value
from kora_trainer.wire.protocol import PackedChecksum


def on_device(named: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The engine's mapped tensors, checked to be on the trainer's device."""
    wrong = {str(t.device) for t in named.values() if t.device != device}
    if wrong:
        raise ValueError(f"the engine's tensors are on {sorted(wrong)}, the trainer's on {device}")
    return named


def sync_device(t: torch.Tensor | None) -> None:
    """The device of `t` synchronised (nothing on CPU)."""
    assert t is not None
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


class Ring:
    """Each engine's ring slots (mapped), doorbells (CPU, shared) and the checksum of a slot's packed adapter."""

    def __init__(self, pack: AdapterPack, size: int):
        self.pack, self.size = pack, size
        self.need = pack.out.numel() * pack.out.element_size()  # the adapter's bytes: at most one slot's
        self.slots: list[list[torch.Tensor]] = []
        self.doorbells: list[torch.Tensor] = []
        self.packed: PackedChecksum | None = None

    def take(self, mapped: list[list[tuple[str, torch.Tensor]]], device: torch.device) -> None:
        named = [dict(m) for m in mapped]
        self.doorbells = [n.pop("doorbell") for n in named if "doorbell" in n]
        self.slots = [list(on_device(n, device).values()) for n in named]
        if any(len(s) != self.size or s[0].numel() < self.need for s in self.slots):
            raise ValueError(f"an engine's ring is not {self.size} slots of {self.need} B")
        pack = self.pack
        self.packed = PackedChecksum([(n, pack.dtype, s) for n, s in zip(pack.names, pack.shapes, strict=True)],
                                     device)

    def pack_into(self, k: int, engines: slice = slice(None)) -> None:
        """The pairs gathered into ring slot k of every engine (of `engines`), enqueued."""
        for ring in self.slots[engines]:
            self.pack.pack_into(ring[k])

    def ring(self, version: int, k: int) -> None:
        """Adapter: the doorbell names slot k (whole: synchronised before) as `version`."""
        word = doorbell_value(version, k)
        for bell in self.doorbells:
            bell.fill_(word)  # one aligned 8-byte store; the engine's lookup reads it with one load

    def digest(self, k: int) -> str:
        """What the engines were given in slot k (read back from engine 0's memory)."""
        assert self.packed is not None
        return self.packed(self.slots[0][k])


def one_rank_runs(pack: AdapterPack, flat: torch.Tensor, group: Any, slots: int) -> tuple[torch.Tensor, int] | None:
    """With one trainer rank (no group to all-reduce the number over) and a ring of two slots or more, the
    slot's gather index as runs (kernels/gather_delta.runs_of): the delta decision is then taken in the
    gather's own pass, here (Adapter) or on the engine (EngineMerge, the plan's `gather`). Else None."""
    if (group is not None and group.world_size > 1) or pack.tp is not None or pack.flat is None \
            or slots < 2 or pack.flat.data_ptr() != flat.data_ptr() or pack.flat.numel() != flat.numel():
        return None
    return runs_of(pack.index)


class Decision:
    """The delta decision of a colocated push: the number enqueued (with the slot's gather, when there is a ring)
    and read after the push's own synchronise."""

    def __init__(self, flat: torch.Tensor, group: Any, ring: Ring | None, runs: tuple[torch.Tensor, int] | None):
        self.flat, self.group, self.ring, self.runs = flat, group, ring, runs
        self.delta = FlatDelta(flat)
        self.number = torch.zeros(1)  # the number the fused decision leaves (on the adapter's device)
        # ... compared with the previous ring slot in the gather's own pass: (row starts, run, engine 0's slots)
        self.fused: tuple[torch.Tensor, int, list[torch.Tensor]] | None = None
        # ring slot k (-1: Merge) -> the captured decision (and gather) and the number it leaves (`capture`)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if runs is None:  # else the ring slot pushed last is the record (`plan`, or the engine's)
            self.delta.mark_pushed(flat)  # what the HTTP push just sent
            self.delta.local_max(flat)  # the decision's kernels load now (compiled on first use), not in a push

    def plan(self, pushes: int, slots: list[int]) -> None:
        """With `runs` (one trainer rank), Adapter decides in the slot's gather's own pass (kernels/gather_delta.py):
        slot k is compared element by element with the slot pushed before it, which holds exactly what the
        engines were last given (the HTTP push's adapter is gathered into it here), so no copy of the last push is
        kept or updated. Then, on a GPU, `capture` the decision of every slot in `slots`. An engine that gathers
        (EngineMerge) holds all that itself: not called."""
        flat, ring = self.flat, self.ring
        self.number = torch.zeros(1, dtype=torch.float32, device=flat.device)
        if ring is not None and self.runs is not None and ring.slots:
            starts, run = self.runs
            views = [ring.pack.view_of(s) for s in ring.slots[0]]
            gather(flat, starts, views[(pushes - 1) % len(views)], run)  # the slot pushed last: what is served
            gather_max_delta(flat, starts, views[0], self.number, ring.pack.out, run)  # compiled now, not in a push
            self.fused = (starts, run, views)  # a captured graph reads the index: it lives as long as they do
        if flat.is_cuda:
            self.capture(slots)

    def fused_pending(self, k: int) -> torch.Tensor:
        """Slot k gathered (every engine's) and the number against the slot pushed before it, enqueued."""
        assert self.fused is not None and self.ring is not None
        starts, run, views = self.fused
        gather_max_delta(self.flat, starts, views[(k - 1) % len(views)], self.number, views[k], run)
        self.ring.pack_into(k, slice(1, None))
        return self.number

    def capture(self, slots: list[int]) -> None:
        """On a GPU: the delta decision's number and (Adapter, EngineMerge) the gather into ring slot k, captured
        once per slot as one CUDA graph, so the host work of a push before the handshake is one replay, one
        synchronise and one read of pinned memory. Launched op by op from the trainer's actor, those few kernels
        cost several times their device time in host time. The graphs read the flat adapter and the ring slots,
        all at fixed addresses from here on."""
        device, ring = self.flat.device, self.ring
        if ring is not None:  # the gather's kernel loaded outside the capture (into the pack's own buffer)
            ring.pack.pack()
        torch.cuda.synchronize(device)
        pool = torch.cuda.graph_pool_handle()  # one pool: the graphs are replayed one at a time
        for k in slots:
            graph = torch.cuda.CUDAGraph()
            host = torch.zeros(1, dtype=torch.float32, pin_memory=True)  # read after the synchronise, no copy call
            with torch.cuda.graph(graph, pool=pool):
                if k >= 0 and self.fused is not None:
                    number = self.fused_pending(k)
                else:
                    number = self.delta.local_max(self.flat)
                    if k >= 0 and ring is not None:
                        ring.pack_into(k)
                host.copy_(number, non_blocking=True)
            self.graphs[k] = (graph, host)
        torch.cuda.synchronize(device)

    def pending(self, slot: int) -> torch.Tensor:
        """The number (and, slot >= 0, ring slot `slot` gathered, whole on the device), ready to read."""
        captured = self.graphs.get(slot)
        if captured is not None:
            graph, pending = captured
            graph.replay()
            sync_device(self.flat)  # the number in pinned memory, the slot whole before the engine is told
        elif slot >= 0 and self.fused is not None:
            pending = self.fused_pending(slot)
            sync_device(self.flat)
        else:
            pending = self.delta.pending(self.flat, self.group)
            if slot >= 0:
                assert self.ring is not None
                self.ring.pack_into(slot)
                sync_device(self.flat)
        return pending

    def mark_pushed(self) -> None:
        if self.runs is None:  # else the slot just pushed is the record
            self.delta.mark_pushed(self.flat)

    def close(self) -> None:
        self.graphs, self.fused = {}, None
