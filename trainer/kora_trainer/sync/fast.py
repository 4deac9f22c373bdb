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
- Colocated (trainer and engine on the same GPU, SPEC's default deployment): the engine's memory is mapped by
  the trainer ONCE through CUDA IPC (`serialize.py` payloads exchanged at plan time), then a push writes straight
  into it. `ColocatedMerge`: the engine's weights are the destination — one captured fold graph writes every
  adapted weight (W + s·B·A, megatron's fused QKV unfused by a row map into the engine's fused q;k;v buffer,
  see `fuse_rows`), one captured copy graph the frozen tensors (a full push; an incremental push skips them,
  the base is frozen). `AdapterPack.pack_into`: the adapter's one gather lands in the engine's next
  `AdapterRing` slot. Nothing is serialised, copied twice or re-opened per push: the engine only swaps its
  adapter object / version label when told.

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

    def pack_into(self, dst: torch.Tensor) -> None:
        """The gather straight into `dst` (uint8, at least the adapter's bytes): e.g. an engine's `AdapterRing`
        slot mapped through CUDA IPC (colocated). Enqueued on the current stream; synchronise before telling
        the engine."""
        n = self.out.numel() * self.out.element_size()
        if dst.dtype != torch.uint8 or dst.numel() < n:
            raise ValueError(f"pack_into: need a uint8 buffer of at least {n} bytes")
        torch.index_select(self.source(), 0, self.index, out=dst[:n].view(self.dtype))

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
    object). A ring of `slots` lets requests admitted with one of the last slots-1 versions finish on it.
    Colocated, the trainer maps `buffers` once (CUDA IPC), writes slot k with `AdapterPack.pack_into` and the
    engine wraps `weights[k]`: the trainer must cycle the slots in order so a slot is rewritten only after
    slots-1 newer versions."""

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


# ---- Colocated: trainer and engine on the same GPU, the engine's memory mapped once (CUDA IPC) ---------------

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


def span_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One [Σ rows, N] view over 2-D row-major tensors that lie back to back in one storage, in order; else None."""
    if not tensors:
        return None
    first = tensors[0]
    base = first.untyped_storage().data_ptr()
    expect = first.data_ptr()
    for t in tensors:
        if t.dim() != 2 or t.shape[1] != first.shape[1] or t.dtype != first.dtype or not t.is_contiguous() \
                or t.data_ptr() != expect or t.untyped_storage().data_ptr() != base:
            return None
        expect += t.numel() * t.element_size()
    rows = sum(int(t.shape[0]) for t in tensors)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (rows, int(first.shape[1])), (int(first.shape[1]), 1))


class CopyGraph:
    """A fixed list of device copies (dst, src), captured once into a CUDA graph over `streams` parallel branches
    (largest first, each to the least loaded branch) and replayed per push; a plain loop on CPU."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], streams: int = 4):
        self.pairs = [(d, s) for d, s in pairs if d.numel()]
        self.streams = streams
        self.graph: torch.cuda.CUDAGraph | None = None

    @property
    def nbytes(self) -> int:
        return sum(d.numel() * d.element_size() for d, _ in self.pairs)

    def _cuda(self) -> bool:
        return bool(self.pairs) and self.pairs[0][0].is_cuda

    def prepare(self) -> None:
        if self.graph is not None or not self._cuda():
            return
        dev = self.pairs[0][0].device
        n = max(1, min(self.streams, len(self.pairs)))
        loads, work = [0] * n, [[] for _ in range(n)]  # type: ignore[var-annotated]
        for d, s in sorted(self.pairs, key=lambda p: -p[0].numel() * p[0].element_size()):
            i = loads.index(min(loads))
            work[i].append((d, s))
            loads[i] += d.numel() * d.element_size()
        for d, s in self.pairs:  # once outside the capture (lazy init of anything copy_ needs)
            d.copy_(s)
        torch.cuda.synchronize(dev)
        branches = [torch.cuda.Stream(dev) for _ in range(n)]
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream(dev)
        with torch.cuda.graph(graph, stream=capture, capture_error_mode="thread_local"):
            fork = torch.cuda.Event()
            fork.record(capture)
            for b in branches:
                b.wait_event(fork)
            for b, pairs in zip(branches, work, strict=True):
                with torch.cuda.stream(b):
                    for d, s in pairs:
                        d.copy_(s)
            for b in branches:
                join = torch.cuda.Event()
                join.record(b)
                capture.wait_event(join)
        self.graph = graph

    def __call__(self) -> None:
        if self._cuda():
            self.prepare()
            assert self.graph is not None
            self.graph.replay()
            return
        for d, s in self.pairs:
            d.copy_(s)


class ColocatedMerge:
    """Merge mode with the engine on the trainer's GPU: `dst` are the engine's parameters under HF names, mapped
    once through CUDA IPC (`serialize.deserialize_payload` of the engine's named parameters). A push enqueues
    (on the current stream) one replay of a captured fold graph that writes every adapted weight
    W + s·B·A (fp32, rounded once) straight into the engine's weight — a fused QKV into the engine's fused
    q;k;v rows (`fuse_rows` on the engine; without it the fold goes through a scratch buffer and a copy) — and,
    when `full`, one replay each of the graphs that copy the frozen tensors (row-mapped unadapted QKV, plain
    tensors). The base is frozen, so after one full push an incremental push (`full=False`) lands the same
    merged model. The caller synchronises, then tells the engine (version label); there is no engine-side
    apply. Like any in-place update, a forward the engine runs meanwhile sees a mix of versions: pause
    generation around the push or accept that rollouts tagged with the old version ran on mixed weights."""

    def __init__(self, entries: Sequence[Entry], dst: Mapping[str, torch.Tensor], fold_kw: dict | None = None,
                 copy_streams: int = 4):
        adapted: list[FoldItem] = []
        frozen: list[FoldItem] = []
        after_fold: list[tuple[torch.Tensor, torch.Tensor]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scratch_entries = 0
        self.adapted_bytes = 0
        self.nbytes = 0

        def target(name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
            t = dst.get(name)
            if t is None:
                raise KeyError(f"{name}: no such parameter on the engine")
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: engine has {t.dtype} {tuple(t.shape)}, trainer sends {dtype} "
                                 f"{tuple(shape)}")
            return t

        for e in entries:
            if isinstance(e, FoldEntry):
                outs = [target(n, shape, e.dtype) for n, shape in e.outs]
                out = outs[0] if len(outs) == 1 and outs[0].is_contiguous() else span_view(outs)
                post: list[tuple[torch.Tensor, torch.Tensor]] = []
                if out is None:  # the engine holds the outputs apart: fold into a scratch, then copy rows
                    self.scratch_entries += 1
                    out = torch.empty(e.w.shape, dtype=e.dtype, device=e.w.device)
                    start = 0
                    for t in outs:
                        post.append((t, out[start:start + t.shape[0]]))
                        start += t.shape[0]
                item = FoldItem(e.w, out, e.a, e.b, e.scale, e.row_map)
                if e.a is not None:
                    adapted.append(item)
                    after_fold += post
                    self.adapted_bytes += e.nbytes
                else:
                    frozen.append(item)
                    copies += post
                self.nbytes += e.nbytes
            else:
                t = target(e.name, tuple(e.src.shape), e.src.dtype)
                if not t.is_contiguous():
                    raise ValueError(f"{e.name}: the engine's tensor is not contiguous")
                copies.append((t.reshape(-1), e.src.reshape(-1)))
                self.nbytes += e.src.numel() * e.src.element_size()
        kw = fold_kw or {}
        self.fold = GroupedFold(adapted, **kw)
        self.after_fold = CopyGraph(after_fold, copy_streams)
        self.frozen = GroupedFold(frozen, **kw)
        self.copies = CopyGraph(copies, copy_streams)
        w = next((e.w for e in entries if isinstance(e, FoldEntry)), None)
        self.side = torch.cuda.Stream(w.device) if w is not None and w.is_cuda else None

    def prepare(self) -> None:
        """Compile and capture now (before the first push, while no other stream of this process is busy)."""
        for f in (self.fold, self.frozen):
            if f.singles:
                f.prepare()
        self.after_fold.prepare()
        self.copies.prepare()

    def push(self, full: bool = True) -> None:
        """Enqueue the push on the current stream (a full push copies the frozen tensors on a side stream,
        overlapped with the fold, and joins it back)."""
        if not full:
            self.fold()
            self.after_fold()
            return
        if self.side is None:
            self.frozen()
            self.copies()
            self.fold()
            self.after_fold()
            return
        cur = torch.cuda.current_stream(self.side.device)
        self.side.wait_stream(cur)
        with torch.cuda.stream(self.side):
            self.frozen()
            self.copies()
        self.fold()
        self.after_fold()
        cur.wait_stream(self.side)
