"""The GPU fast path for Adapter mode (the Merge-mode plan and sender are plan.py's, the engine side
wire/fast_receive.py's): `AdapterPack` gathers the HF-PEFT adapter with ONE `index_select` from the adapter's
parameters laid end to end into one flat buffer (TP > 1: from the gathered flat adapters), `FlatDelta` decides
the delta-skip with one fused max-abs-diff and one all-reduce of one number (`delta.should_push`'s rule).
`AdapterPack.pack_into` writes straight into an engine's `AdapterRing` slot mapped over CUDA IPC (colocated).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kora_trainer.kernels.gather_delta import gather, gather_max_delta
from kora_trainer.sync.fast.plan import GatherSpec
from kora_trainer.wire.fast_receive import nbytes
from kora_trainer.wire.group import WeightUpdateGroup
from kora_trainer.wire.protocol import Bucket, Piece, dtype_name


def flat_view(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one buffer `params` lie in end to end (in order), or None if they do not."""
    if not params:
        return None
    first = params[0]
    base = first.untyped_storage()
    expect = first.data_ptr()
    for p in params:
        if p.untyped_storage().data_ptr() != base.data_ptr() or p.data_ptr() != expect or not p.is_contiguous() \
                or p.dtype != first.dtype:
            return None
        expect += p.numel() * p.element_size()
    n = sum(p.numel() for p in params)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        base, first.storage_offset(), (n,), (1,))


def flatten_parameters(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """Move `params` into one contiguous buffer (each parameter becomes a view of it; values kept). Do it before
    the optimizer makes its state. Returns the buffer."""
    if not params:
        raise ValueError("no parameters to flatten")
    dtype, device = params[0].dtype, params[0].device
    if any(p.dtype != dtype or p.device != device for p in params):
        raise ValueError("flatten_parameters: one dtype and device for all")
    flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
    off = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            view = flat[off:off + n].view(p.shape)
            view.copy_(p.data)
            p.data = view
            off += n
    return flat


def _spec_index(s: GatherSpec, base: int, shape: tuple[int, int], numel: int) -> torch.Tensor:
    """The flat index (into the gathered flat adapters: rank r's at r * numel) of every element of one HF tensor,
    row-major; its source starts at `base` in its rank's flat adapter."""
    m, n = s.src.shape
    rows = torch.arange(shape[0]) if s.rows is None else s.rows.cpu().long()
    if s.split == 0:  # full row R is row R % m of rank R // m
        idx = ((rows // m) * numel + base + (rows % m) * n).unsqueeze(1) + torch.arange(n).unsqueeze(0)
    elif s.split == 1:  # full column C is column C % n of rank C // n
        cols = torch.arange(shape[1])
        idx = (base + rows * n).unsqueeze(1) + ((cols // n) * numel + cols % n).unsqueeze(0)
    else:
        idx = (base + rows * n).unsqueeze(1) + torch.arange(n).unsqueeze(0)
    return idx.reshape(-1)


def _whole_tensor_buckets(names: list[str], shapes: list[tuple[int, int]], dtype: torch.dtype, cap: int
                          ) -> list[Bucket]:
    """Tensors packed in order into buckets of at most `cap` bytes, never split (one larger tensor travels alone)."""
    buckets: list[Bucket] = [Bucket()]
    for name, shape in zip(names, shapes, strict=True):
        n = nbytes(shape, dtype)
        if buckets[-1].pieces and buckets[-1].nbytes + n > cap:
            buckets.append(Bucket())
        buckets[-1].pieces.append(Piece(name, dtype_name(dtype), shape, 0, n))
    return buckets


class AdapterPack:
    """The HF-PEFT adapter as one gather from the flat adapter parameters into one flat buffer.

    `params` are the live adapter parameters (any layout: if they are not already views of one buffer they
    are concatenated first, one launch). `specs` say which rows of which parameter each HF tensor is.
    TP > 1 (`tp`: the TP group): every TP rank makes one and calls `pack` / `push` / `pack_into` together; the
    flat adapters are gathered to TP rank 0 ([tp, numel], rank order) and rank 0's one `index_select` reads
    every rank's shards from there. Only rank 0's `out` holds the adapter.
    """

    def __init__(self, params: Sequence[torch.Tensor], specs: Sequence[GatherSpec], cap: int,
                 tp: WeightUpdateGroup | None = None):
        self.params = list(params)
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.leader = self.tp is None or self.tp.rank == 0
        size = self.tp.world_size if self.tp is not None else 1
        self.flat = flat_view(self.params)
        dtype, device = self.params[0].dtype, self.params[0].device
        self.dtype = dtype
        offsets, off = {}, 0
        for p in self.params:
            offsets[p.data_ptr()] = off
            off += p.numel()
        self.numel = off
        index = []
        self.names: list[str] = []
        self.shapes: list[tuple[int, int]] = []
        for s in specs:
            base = offsets.get(s.src.data_ptr())
            if base is None or s.src.dtype != dtype:
                raise ValueError(f"{s.name}: its source is not one of the adapter parameters (or another dtype)")
            shape = s.full_shape(size)
            index.append(_spec_index(s, base, shape, self.numel))
            self.names.append(s.name)
            self.shapes.append(shape)
        idx = torch.cat(index)
        self.index = idx.to(device=device, dtype=torch.int32 if size * self.numel < 2**31 else torch.int64)
        self.out = torch.empty(idx.numel(), dtype=dtype, device=device)
        self.staging = None if self.flat is not None else torch.empty(self.numel, dtype=dtype, device=device)
        self.gathered = torch.empty(size * self.numel if self.tp is not None and self.leader else 0, dtype=dtype,
                                    device=device)
        # buckets: whole tensors (a pair never split: A and B of one module are consecutive and small)
        self.buckets = _whole_tensor_buckets(self.names, self.shapes, dtype, cap)
        self.bounds = []
        start = 0
        for b in self.buckets:
            self.bounds.append((start, start + b.nbytes))
            start += b.nbytes

    def local(self) -> torch.Tensor:
        """This rank's adapter parameters as one flat tensor (a view when they are flattened)."""
        if self.flat is not None:
            return self.flat
        assert self.staging is not None
        torch.cat([p.detach().reshape(-1) for p in self.params], out=self.staging)
        return self.staging

    def source(self) -> torch.Tensor:
        """What the index reads: the local flat adapter, or under TP every rank's, gathered to rank 0 (every TP
        rank calls it; the others get their local one back)."""
        local = self.local()
        if self.tp is None:
            return local
        n = self.numel
        outs = [self.gathered[r * n:(r + 1) * n] for r in range(self.tp.world_size)] if self.leader else None
        self.tp.gather(local, outs)
        return self.gathered if self.leader else local

    def pack(self) -> torch.Tensor:
        """Every HF tensor into `self.out` (one gather); returns its bytes (TP rank 0's only are filled)."""
        src = self.source()
        if self.leader:
            torch.index_select(src, 0, self.index, out=self.out)
        return self.out.view(torch.uint8)

    def view_of(self, dst: torch.Tensor) -> torch.Tensor:
        """The adapter's elements at the start of `dst` (uint8, at least the adapter's bytes: a ring slot)."""
        n = self.out.numel() * self.out.element_size()
        if dst.dtype != torch.uint8 or dst.numel() < n:
            raise ValueError(f"pack_into: need a uint8 buffer of at least {n} bytes")
        return dst[:n].view(self.dtype)

    def pack_into(self, dst: torch.Tensor | None) -> None:
        """The gather straight into `dst` (uint8, at least the adapter's bytes): e.g. an engine's `AdapterRing`
        slot mapped through CUDA IPC (colocated). Enqueued on the current stream; synchronise before telling
        the engine. TP ranks other than 0 pass None (they only send their shards)."""
        src = self.source()
        if not self.leader:
            return
        if dst is None:
            raise ValueError("pack_into: TP rank 0 needs the buffer to write")
        torch.index_select(src, 0, self.index, out=self.view_of(dst))

    def push(self, group: WeightUpdateGroup | None) -> None:
        """Pack and broadcast over `group` (TP ranks other than 0: None, they only send their shards)."""
        flat = self.pack()
        if not self.leader:
            return
        if group is None:
            raise ValueError("TP rank 0 needs the weight-update group")
        for start, end in self.bounds:
            group.broadcast(flat[start:end], src=0)

    @property
    def metadata(self) -> list[dict[str, list[Any]]]:
        return [b.metadata() for b in self.buckets]


class FlatDelta:
    """Delta-skip on the flat adapter: max |now − last pushed| in one pass over the adapter (exact fp32
    differences, kernels/gather_delta.py), MAX-all-reduced over the trainer's group (one number), one host read."""

    def __init__(self, source: torch.Tensor):
        self.last: torch.Tensor | None = None
        self.device = source.device
        self.number = torch.zeros(1, dtype=torch.float32, device=source.device)

    def local_max(self, now: torch.Tensor) -> torch.Tensor:
        """The number, enqueued: the one `self.number` tensor each call (read it before the next call)."""
        if self.last is None:
            return self.number.fill_(float("inf"))
        gather_max_delta(now, None, self.last, self.number)
        return self.number

    def should_push(self, now: torch.Tensor, threshold: float, group: WeightUpdateGroup | None = None
                    ) -> tuple[bool, float]:
        """Collective: every rank of `group` calls it every step and gets the same answer."""
        return self.decide(self.pending(now, group), threshold)

    def pending(self, now: torch.Tensor, group: WeightUpdateGroup | None = None) -> torch.Tensor:
        """The decision's number, enqueued (all-reduced over `group`), not read yet: a caller that synchronises
        anyway reads it after its own work (`decide`) and pays no host read of its own. float64, as
        delta.collective_max's: a rank on the HTTP path (a data-parallel rank without engines) meets this one in
        the same all-reduce, and gloo aborts the process on a size mismatch."""
        d = self.local_max(now).double()
        if group is not None and group.world_size > 1:
            group.allreduce_max(d)
        return d

    @staticmethod
    def decide(pending: torch.Tensor, threshold: float) -> tuple[bool, float]:
        value = float(pending.item())
        return value > threshold, value

    def mark_pushed(self, now: torch.Tensor) -> None:
        if self.last is None:
            self.last = torch.empty(now.numel(), dtype=torch.float32, device=now.device)
        gather(now.reshape(-1), None, self.last)
