"""The GPU fast path of weight sync: a sync plan fixed once, then every step is a few launches per bucket
with the fold of bucket i+1 overlapped with the broadcast of bucket i.

The HTTP path (`sender.WeightSender` + the engine routes) re-plans, re-packs and hashes every bucket on every
push; on NVLink that bookkeeping, not the link, sets the time. Between two steps nothing about the layout
changes — the same tensors go to the same bytes of the same buckets — so here everything is planned once:

- `MergePlan` (Merge mode): the whole model under HF names in buckets of at most `cap` bytes (the layout of
  `protocol.plan_buckets`: pieces back to back, a plain tensor may be split over buckets as byte ranges, a
  folded weight never is). Each bucket is filled by ONE replay of a captured fold graph
  (`kernels.fold.GroupedFold`: every adapted weight of the bucket, W + s·B·A in fp32 rounded once, written
  straight into the bucket in HF layout — megatron's fused QKV is unfused by a row map in the same pass) plus
  one device copy per plain piece.
- `PipelinedSender` / `PipelinedReceiver`: a ring of bucket buffers and three CUDA streams. The trainer packs
  bucket i+1 on a pack stream while bucket i is on the wire (NCCL's stream); the receiver applies bucket i
  into the engine's parameters on an apply stream while bucket i+1 arrives. Events order reuse of a buffer.
  The host only enqueues: nothing waits for the GPU until the final `ack`.
- `AdapterPack` (Adapter mode): the HF-PEFT adapter as ONE gather (`index_select`) from the adapter's
  parameters laid end to end, into one flat buffer; `AdapterRing` on the engine side receives it into one of
  a ring of buffers whose tensor views were made once, and the new adapter object is registered — the engine
  serves it from the next request on, with no copy and no per-tensor work.
- `FlatDelta`: the delta-skip decision as one fused max-abs-diff over the flat adapter and one all-reduce of
  one number (`delta.should_push`'s rule — collective MAX, never a per-rank return).

Metadata that a generic engine needs (names, dtypes, shapes, byte ranges per bucket) comes from
`MergePlan.buckets` in `protocol.Bucket` form, so an engine can also take these buckets through
`/update_weights_from_distributed` (load_format flattened_bucket). On CPU (gloo) the same classes run
sequentially without streams, which is what the CPU tests exercise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kora_trainer.kernels.fold import FoldItem, GroupedFold
from kora_trainer.sync.group import WeightUpdateGroup
from kora_trainer.sync.protocol import Bucket, Piece, dtype_name

Named = tuple[str, torch.Tensor]


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return n


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view."""
    if not t.is_contiguous():
        raise ValueError("fast sync needs contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


@dataclass
class PlainEntry:
    """A tensor sent as it is, under `name` (may be split over buckets)."""

    name: str
    src: torch.Tensor  # contiguous


@dataclass
class FoldEntry:
    """One source weight W [M, N] folded (or, a is None, copied) into one or several consecutive HF tensors
    (their rows concatenated = M rows, placed by row_map). Never split over buckets."""

    outs: list[tuple[str, tuple[int, ...]]]  # HF names and shapes, in bucket order
    w: torch.Tensor
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    scale: float = 1.0
    row_map: torch.Tensor | None = None  # [M] int32: row of the concatenated outputs each W row goes to

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


Entry = PlainEntry | FoldEntry


@dataclass
class _BucketWork:
    copies: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (src bytes, bucket offset, n)
    folds: list[tuple[FoldEntry, int]] = field(default_factory=list)  # (entry, bucket offset)


class MergePlan:
    """Entries packed into buckets of at most `cap` bytes, in order (see the module docstring)."""

    def __init__(self, entries: Sequence[Entry], cap: int):
        if cap <= 0:
            raise ValueError("sync.bufferSize must be positive")
        self.cap = cap
        self.buckets: list[Bucket] = [Bucket()]
        self.work: list[_BucketWork] = [_BucketWork()]
        for e in entries:
            if isinstance(e, FoldEntry):
                if e.nbytes > cap:
                    raise ValueError(f"{e.outs[0][0]}: a folded weight of {e.nbytes} bytes does not fit in "
                                     f"sync.bufferSize {cap}")
                if self.buckets[-1].nbytes + e.nbytes > cap:
                    self._new()
                self.work[-1].folds.append((e, self.buckets[-1].nbytes))
                for name, shape in e.outs:
                    n = _nbytes(shape, e.dtype)
                    self.buckets[-1].pieces.append(Piece(name, dtype_name(e.dtype), tuple(shape), 0, n))
                continue
            src = _bytes(e.src)
            total, start = src.numel(), 0
            while start < total or total == 0:
                room = cap - self.buckets[-1].nbytes
                if room <= 0:
                    self._new()
                    room = cap
                end = min(total, start + room)
                self.work[-1].copies.append((src[start:end], self.buckets[-1].nbytes, end - start))
                self.buckets[-1].pieces.append(Piece(e.name, dtype_name(e.src.dtype), tuple(e.src.shape), start, end))
                start = end
                if total == 0:
                    break
        if not self.buckets[-1].pieces:
            self.buckets.pop()
            self.work.pop()

    def _new(self) -> None:
        self.buckets.append(Bucket())
        self.work.append(_BucketWork())

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def metadata(self) -> list[dict[str, list]]:  # type: ignore[type-arg]
        return [b.metadata() for b in self.buckets]


class _Streams:
    """Pack/apply and communication streams + a ring of events; no-ops on CPU."""

    def __init__(self, device: torch.device, slots: int, n: int):
        self.cuda = device.type == "cuda"
        self.work = torch.cuda.Stream(device) if self.cuda else None
        self.comm = torch.cuda.Stream(device) if self.cuda else None
        self.filled = [torch.cuda.Event() for _ in range(n)] if self.cuda else []
        self.freed = [torch.cuda.Event() for _ in range(slots)] if self.cuda else []

    def on(self, stream: torch.cuda.Stream | None):  # type: ignore[no-untyped-def]
        import contextlib

        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class PipelinedSender:
    """Trainer rank 0: fill (fold + copy) bucket i+1 while bucket i is broadcast. `push()` only enqueues."""

    def __init__(self, plan: MergePlan, group: WeightUpdateGroup, slots: int = 2, fold_kw: dict | None = None):
        self.plan, self.group, self.slots = plan, group, slots
        self.device = group.device
        size = max((b.nbytes for b in plan.buckets), default=0)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(slots)]
        self.folds: list[GroupedFold] = []
        for i, work in enumerate(plan.work):
            buf = self.buffers[i % slots]
            items = []
            for e, off in work.folds:
                out = buf[off:off + e.nbytes].view(e.dtype).view(e.w.shape)
                items.append(FoldItem(e.w, out, e.a, e.b, e.scale, e.row_map))
            self.folds.append(GroupedFold(items, **(fold_kw or {})))
        if self.device.type == "cuda":  # compile + capture now, before any collective is in flight
            for f in self.folds:
                f.prepare()
        self.streams = _Streams(self.device, slots, len(plan.buckets))

    def fill(self, i: int) -> torch.Tensor:
        """Bucket i's bytes into its ring buffer (on the current stream); returns the buffer slice."""
        buf = self.buffers[i % self.slots]
        self.folds[i]()
        for src, off, n in self.plan.work[i].copies:
            buf[off:off + n].copy_(src)
        return buf[:self.plan.buckets[i].nbytes]

    def push(self) -> None:
        s = self.streams
        if not s.cuda:
            for i in range(len(self.plan.buckets)):
                self.group.broadcast(self.fill(i), src=0)
            return
        s.work.wait_stream(torch.cuda.current_stream(self.device))  # the optimizer step that made the adapter
        for i in range(len(self.plan.buckets)):
            slot = i % self.slots
            with s.on(s.work):
                s.work.wait_event(s.freed[slot])  # bucket i - slots has left this buffer
                flat = self.fill(i)
                s.filled[i].record(s.work)
            with s.on(s.comm):
                s.comm.wait_event(s.filled[i])
                self.group.broadcast(flat, src=0)  # NCCL waits for the comm stream; comm waits for NCCL
                s.freed[slot].record(s.comm)
        torch.cuda.current_stream(self.device).wait_stream(s.comm)


class PipelinedReceiver:
    """Engine side: receive bucket i+1 while bucket i is copied into the parameters. Plan-time views only."""

    def __init__(self, metadata: Sequence[Mapping[str, list]], params: Mapping[str, torch.Tensor],  # type: ignore[type-arg]
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
                pairs.append((_bytes(p.detach())[int(start):int(end)], buf[off:off + n]))
                off += n
            self.applies.append(pairs)
        self.streams = _Streams(self.device, slots, len(metadata))

    def receive(self) -> None:
        s = self.streams
        if not s.cuda:
            for i, pairs in enumerate(self.applies):
                self.group.broadcast(self.buffers[i % self.slots][:self.sizes[i]], src=0)
                for dst, src in pairs:
                    dst.copy_(src)
            return
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
    the engine enqueued on its current stream. Both sides call it; the trainer then synchronizes."""
    t = torch.zeros(1, dtype=torch.int32, device=group.device)
    group.broadcast(t, src=engine_rank)


# ---- Adapter mode ----------------------------------------------------------------------------------------

@dataclass
class GatherSpec:
    """One HF-PEFT tensor = rows `rows` (None: all) of the 2-D adapter parameter `src`."""

    name: str
    src: torch.Tensor
    rows: torch.Tensor | None = None  # int64 [rows of the output]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.src.shape[0] if self.rows is None else int(self.rows.numel()), self.src.shape[1])


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


class AdapterPack:
    """The HF-PEFT adapter as one gather from the flat adapter parameters into one flat buffer.

    `params` are the live adapter parameters (any layout: if they are not already views of one buffer they
    are concatenated first, one launch). `specs` say which rows of which parameter each HF tensor is.
    """

    def __init__(self, params: Sequence[torch.Tensor], specs: Sequence[GatherSpec], cap: int):
        self.params = list(params)
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
            cols = s.src.shape[1]
            rows = torch.arange(s.src.shape[0]) if s.rows is None else s.rows.cpu().long()
            index.append((base + rows.unsqueeze(1) * cols + torch.arange(cols).unsqueeze(0)).reshape(-1))
            self.names.append(s.name)
            self.shapes.append(s.shape)
        idx = torch.cat(index)
        self.index = idx.to(device=device, dtype=torch.int32 if self.numel < 2**31 else torch.int64)
        self.out = torch.empty(idx.numel(), dtype=dtype, device=device)
        self.staging = None if self.flat is not None else torch.empty(self.numel, dtype=dtype, device=device)
        # buckets: whole tensors (a pair never split: A and B of one module are consecutive and small)
        self.buckets: list[Bucket] = [Bucket()]
        for name, shape in zip(self.names, self.shapes, strict=True):
            n = _nbytes(shape, dtype)
            if self.buckets[-1].pieces and self.buckets[-1].nbytes + n > cap:
                self.buckets.append(Bucket())
            self.buckets[-1].pieces.append(Piece(name, dtype_name(dtype), shape, 0, n))
        self.bounds = []
        start = 0
        for b in self.buckets:
            self.bounds.append((start, start + b.nbytes))
            start += b.nbytes

    def source(self) -> torch.Tensor:
        if self.flat is not None:
            return self.flat
        assert self.staging is not None
        torch.cat([p.detach().reshape(-1) for p in self.params], out=self.staging)
        return self.staging

    def pack(self) -> torch.Tensor:
        """Every HF tensor into `self.out` (one gather); returns its bytes."""
        torch.index_select(self.source(), 0, self.index, out=self.out)
        return self.out.view(torch.uint8)

    def push(self, group: WeightUpdateGroup) -> None:
        flat = self.pack()
        for start, end in self.bounds:
            group.broadcast(flat[start:end], src=0)

    @property
    def metadata(self) -> list[dict[str, list]]:  # type: ignore[type-arg]
        return [b.metadata() for b in self.buckets]


class AdapterRing:
    """Engine side of `AdapterPack`: a ring of flat buffers, each with its {module: (A, B, scaling)} views made
    once. `receive()` fills the next buffer and returns its weights dict (to wrap in the engine's adapter
    object). A ring of `slots` lets requests admitted with one of the last slots-1 versions finish on it."""

    def __init__(self, metadata: Sequence[Mapping[str, list]], device: torch.device, scaling: Mapping[str, float],  # type: ignore[type-arg]
                 slots: int = 3):
        from kora_trainer.rollout.lora_adapters import split_lora_name
        from kora_trainer.sync.protocol import dtype_of

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
                    n = _nbytes(shape, dt)
                    halves.setdefault(module, {})[which] = buf[off:off + n].view(dt).view(*shape)
                    off += n
            weights = {}
            for module, h in halves.items():
                a, b = h["A"], h["B"]
                self.rank = max(self.rank, a.shape[0])
                weights[module] = (a, b, float(scaling.get(module, scaling.get("*", 1.0))))
            self.weights.append(weights)
        self.next = 0

    def receive(self, group: WeightUpdateGroup) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        slot = self.next
        self.next = (self.next + 1) % len(self.buffers)
        start = 0
        for n in self.sizes:
            group.broadcast(self.buffers[slot][start:start + n], src=0)
            start += n
        return self.weights[slot]


class FlatDelta:
    """Delta-skip on the flat adapter: max |now − last pushed| in one reduction over the whole adapter (exact
    fp32 differences), MAX-all-reduced over the trainer's group (one number), one host read."""

    def __init__(self, source: torch.Tensor):
        self.last: torch.Tensor | None = None
        self.device = source.device

    def local_max(self, now: torch.Tensor) -> torch.Tensor:
        if self.last is None:
            return torch.full((1,), float("inf"), device=self.device)
        return torch.linalg.vector_norm(now.float() - self.last if now.dtype != torch.float32 else now - self.last,
                                        ord=float("inf")).reshape(1)

    def should_push(self, now: torch.Tensor, threshold: float, group: WeightUpdateGroup | None = None
                    ) -> tuple[bool, float]:
        """Collective: every rank of `group` calls it every step and gets the same answer."""
        d = self.local_max(now)
        if group is not None and group.world_size > 1:
            group.allreduce_max(d)
        value = float(d.item())
        return value > threshold, value

    def mark_pushed(self, now: torch.Tensor) -> None:
        if self.last is None:
            self.last = torch.empty(now.shape, dtype=torch.float32, device=now.device)
        self.last.copy_(now)
