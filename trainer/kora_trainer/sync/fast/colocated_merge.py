"""Colocated Merge on one GPU (trainer and engine share it): the engine's weights, mapped once through CUDA IPC,
are the destination. `ColocatedMerge` writes every adapted weight with one captured fold graph (megatron's
fused QKV unfused by a row map into the engine's fused q;k;v buffer: `wire.fast_receive.fuse_rows`) and the frozen
tensors with one captured copy graph (`CopyGraph`; an incremental push skips them). The trainer's colocated sync
(sync/fast/colocated_modes.py) and bench/gpu_sync_colocated.py use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kora_trainer.kernels.fold import FoldItem, GroupedFold
from kora_trainer.sync.fast.plan import Entry, FoldEntry


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
        graph.replay()  # the first launch uploads the graph: here, not in the first push (same bytes as above)
        torch.cuda.synchronize(dev)
        self.graph = graph

    def __call__(self) -> None:
        if self._cuda():
            self.prepare()
            assert self.graph is not None
            self.graph.replay()
            return
        for d, s in self.pairs:
            d.copy_(s)


def _target(dst: Mapping[str, torch.Tensor], name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The engine's tensor `name`, checked to be what the trainer sends."""
    t = dst.get(name)
    if t is None:
        raise KeyError(f"{name}: no such parameter on the engine")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: engine has {t.dtype} {tuple(t.shape)}, trainer sends {dtype} {tuple(shape)}")
    return t


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

    def __init__(self, entries: Sequence[Entry], dst: Mapping[str, torch.Tensor], fold_kw: dict[str, Any] | None = None,
                 copy_streams: int = 4):
        adapted: list[FoldItem] = []
        frozen: list[FoldItem] = []
        after_fold: list[tuple[torch.Tensor, torch.Tensor]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scratch_entries = 0
        self.adapted_bytes = 0
        self.nbytes = 0
        for e in entries:
            if isinstance(e, FoldEntry) and e.sharded:
                raise NotImplementedError("colocated Merge sync of a tensor-parallel policy is not wired (TP = 1)")
            if isinstance(e, FoldEntry):
                item, post = self._fold_item(e, dst)
                if e.a is not None:
                    adapted.append(item)
                    after_fold += post
                    self.adapted_bytes += e.nbytes
                else:
                    frozen.append(item)
                    copies += post
                self.nbytes += e.nbytes
            else:
                t = _target(dst, e.name, tuple(e.src.shape), e.src.dtype)
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

    def _fold_item(self, e: FoldEntry, dst: Mapping[str, torch.Tensor]
                   ) -> tuple[FoldItem, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The fold (or copy) of one entry straight into the engine's tensors, and the row copies after it where the
        engine holds the outputs apart (then the fold goes into a scratch buffer)."""
        outs = [_target(dst, n, shape, e.dtype) for n, shape in e.outs]
        out = outs[0] if len(outs) == 1 and outs[0].is_contiguous() else span_view(outs)
        post: list[tuple[torch.Tensor, torch.Tensor]] = []
        if out is None:  # the engine holds the outputs apart: fold into a scratch, then copy rows
            self.scratch_entries += 1
            out = torch.empty(e.w.shape, dtype=e.dtype, device=e.w.device)
            start = 0
            for t in outs:
                post.append((t, out[start:start + t.shape[0]]))
                start += t.shape[0]
        return FoldItem(e.w, out, e.a, e.b, e.scale, e.row_map), post

    def prepare(self, full: bool = True) -> None:
        """Compile and capture now (before the first push, while no other stream of this process is busy); the
        frozen tensors' graphs only when full pushes will be made."""
        for f in (self.fold, self.frozen) if full else (self.fold,):
            if f.singles:
                f.prepare()
        self.after_fold.prepare()
        if full:
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
