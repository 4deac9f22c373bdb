"""The engine's side of the GPU fast path (sync/fast/plan.py is the trainer's): what both sides must agree on byte
for byte, and the receivers.

- `PipelinedReceiver`: receive bucket i+1 while bucket i is copied into the engine's parameters (a ring of
  bucket buffers, a communication and an apply stream, events ordering the reuse of a buffer).
- `AdapterRing`: a ring of flat adapter buffers whose {module: (A, B, scaling)} views are made once; a push is
  one broadcast into the next slot.
- `ack`: the engine's "done", ordered after everything it enqueued.
- `nbytes`, `as_bytes`, `Streams`: the byte layout and the stream skeleton the sender (sync/fast/plan.py) shares.
On CPU (gloo) the same classes run sequentially without streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kora_trainer.wire.group import WeightUpdateGroup
from kora_trainer.wire.lora_names import split_lora_name
from kora_trainer.wire.protocol import dtype_name, dtype_of


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return n


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view."""
    if not t.is_contiguous():
        raise ValueError("fast sync needs contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


class Streams:
    """Pack/apply and communication streams + a ring of events; no-ops on CPU."""

    def __init__(self, device: torch.device, slots: int, n: int):
        self.cuda = device.type == "cuda"
        self.work = torch.cuda.Stream(device) if self.cuda else None
        self.comm = torch.cuda.Stream(device) if self.cuda else None
        self.filled = [torch.cuda.Event() for _ in range(n)] if self.cuda else []
        self.freed = [torch.cuda.Event() for _ in range(slots)] if self.cuda else []

    def on(self, stream: torch.cuda.Stream | None):  # type: ignore[no-untyped-def]

        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class PipelinedReceiver:
    """Engine side: receive bucket i+1 while bucket i is copied into the parameters. Plan-time views only."""

    def __init__(self, metadata: Sequence[Mapping[str, list[Any]]], params: Mapping[str, torch.Tensor],
                 group: WeightUpdateGroup, slots: int = 2):
        self.group, self.slots = group, slots
        self.device = group.device
        self.sizes = [sum(int(e) - int(s) for s, e in m["byte_ranges"]) for m in metadata]
        self.buffers = [torch.empty(max(self.sizes, default=0), dtype=torch.uint8, device=self.device)
                        for _ in range(slots)]
        self.applies: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for i, m in enumerate(metadata):
            buf, off, pairs = self.buffers[i % slots], 0, []
            for name, dtype, shape, (start, end) in zip(m["names"], m["dtypes"], m["shapes"], m["byte_ranges"],
                                                        strict=True):
                p = params.get(name)
                if p is None:
                    raise KeyError(f"{name}: no such parameter on the engine")
                if dtype_name(p.dtype) != dtype or list(p.shape) != list(shape):
                    raise ValueError(f"{name}: engine has {p.dtype} {tuple(p.shape)}, trainer sends {dtype} {shape}")
                n = int(end) - int(start)
                pairs.append((as_bytes(p.detach())[int(start):int(end)], buf[off:off + n]))
                off += n
            self.applies.append(pairs)
        self.streams = Streams(self.device, slots, len(metadata))

    def receive(self) -> None:
        s = self.streams
        if not s.cuda:
            for i, pairs in enumerate(self.applies):
                self.group.broadcast(self.buffers[i % self.slots][:self.sizes[i]], src=0)
                for dst, src in pairs:
                    dst.copy_(src)
            return
        assert s.comm is not None and s.work is not None  # Streams makes both on CUDA
        s.comm.wait_stream(torch.cuda.current_stream(self.device))
        for i, pairs in enumerate(self.applies):
            slot = i % self.slots
            with s.on(s.comm):
                s.comm.wait_event(s.freed[slot])  # bucket i - slots has been applied from this buffer
                self.group.broadcast(self.buffers[slot][:self.sizes[i]], src=0)
                s.filled[i].record(s.comm)
            with s.on(s.work):
                s.work.wait_event(s.filled[i])
                for dst, src in pairs:
                    dst.copy_(src)
                s.freed[slot].record(s.work)
        torch.cuda.current_stream(self.device).wait_stream(s.work)


def ack(group: WeightUpdateGroup, engine_rank: int = 1) -> None:
    """The engine tells the trainer it is done: one 4-byte broadcast from the engine, ordered after everything
    the engine enqueued on its current stream. Every member calls it; the trainer then synchronizes. With
    several engines in the group all of them must be done: a MAX all-reduce of one number instead (the
    trainer's result needs every engine's contribution, each ordered after that engine's work)."""
    t = torch.zeros(1, dtype=torch.int32, device=group.device)
    if group.world_size > 2:
        group.allreduce_max(t)
    else:
        group.broadcast(t, src=engine_rank)


class AdapterRing:
    """Engine side of `AdapterPack`: a ring of flat buffers, each with its {module: (A, B, scaling)} views made
    once. `receive()` fills the next buffer and returns its weights dict (to wrap in the engine's adapter
    object). A ring of `slots` lets requests admitted with one of the last slots-1 versions finish on it.
    Colocated, the trainer maps `buffers` once (CUDA IPC), writes slot k with `AdapterPack.pack_into` and the
    engine wraps `weights[k]`: the trainer must cycle the slots in order so a slot is rewritten only after
    slots-1 newer versions."""

    def __init__(self, metadata: Sequence[Mapping[str, list[Any]]], device: torch.device, scaling: Mapping[str, float],
                 slots: int = 3):
        self.sizes = [sum(int(e) - int(s) for s, e in m["byte_ranges"]) for m in metadata]
        total = sum(self.sizes)
        self.buffers = [torch.empty(total, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.weights: list[dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = []
        self.rank = 0
        for buf in self.buffers:
            halves: dict[str, dict[str, torch.Tensor]] = {}
            off = 0
            for m in metadata:
                for name, dtype, shape in zip(m["names"], m["dtypes"], m["shapes"], strict=True):
                    parsed = split_lora_name(name)
                    if parsed is None:
                        raise ValueError(f"{name} is not a LoRA tensor name")
                    module, which = parsed
                    dt = dtype_of(dtype)
                    n = nbytes(shape, dt)
                    halves.setdefault(module, {})[which] = buf[off:off + n].view(dt).view(*shape)
                    off += n
            weights = {}
            for module, h in halves.items():
                a, b = h["A"], h["B"]
                self.rank = max(self.rank, a.shape[0])
                weights[module] = (a, b, float(scaling.get(module, scaling.get("*", 1.0))))
            self.weights.append(weights)
        self.next = 0
        self.last = -1  # the slot received last

    def receive(self, group: WeightUpdateGroup) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        slot = self.last = self.next
        self.next = (self.next + 1) % len(self.buffers)
        start = 0
        for n in self.sizes:
            group.broadcast(self.buffers[slot][start:start + n], src=0)
            start += n
        return self.weights[slot]


DOORBELL_SLOT_BITS = 8  # a colocated adapter ring's doorbell word: version << DOORBELL_SLOT_BITS | slot


def doorbell_value(version: int, slot: int) -> int:
    """The word a colocated trainer stores to publish `AdapterRing` slot `slot` as policy `version`
    (kora_engine/lm/colocated_routes.py reads it before every adapter lookup)."""
    if not 0 <= slot < 1 << DOORBELL_SLOT_BITS or not 0 <= version < 1 << (63 - DOORBELL_SLOT_BITS):
        raise ValueError(f"doorbell: slot {slot} or version {version} out of range")
    return version << DOORBELL_SLOT_BITS | slot


def doorbell_parts(value: int) -> tuple[int, int]:
    """(version, slot) of a doorbell word."""
    return value >> DOORBELL_SLOT_BITS, value & ((1 << DOORBELL_SLOT_BITS) - 1)


def fuse_rows(params: Mapping[str, torch.Tensor], groups: Sequence[Sequence[str]]) -> None:
    """Engine side: re-home each group of 2-D parameters (e.g. one layer's q, k, v) into ONE buffer, rows back
    to back in the group's order, values kept (each parameter's `.data` becomes a view of it). That is SGLang's
    fused `qkv_proj` layout, and it lets a colocated fold write a fused megatron QKV in one row-mapped pass."""
    with torch.no_grad():
        for names in groups:
            ps = [params[n] for n in names]
            if any(p.dim() != 2 or p.shape[1] != ps[0].shape[1] or p.dtype != ps[0].dtype for p in ps):
                raise ValueError(f"fuse_rows: {list(names)} are not 2-D weights of one width and dtype")
            buf = torch.empty((sum(p.shape[0] for p in ps), ps[0].shape[1]), dtype=ps[0].dtype, device=ps[0].device)
            off = 0
            for p in ps:
                view = buf[off:off + p.shape[0]]
                view.copy_(p.data)
                p.data = view
                off += p.shape[0]
