"""The GPU fast path of weight sync: a sync plan fixed once, then every step is a few launches per bucket
with the fold of bucket i+1 overlapped with the broadcast of bucket i.

The HTTP path (`sender.WeightSender` + the engine routes) re-plans, re-packs and hashes every bucket on every
push; on NVLink that bookkeeping, not the link, sets the time. Between two steps nothing about the layout
changes — the same tensors go to the same bytes of the same buckets — so here everything is planned once:

- `MergePlan` (Merge mode): the whole model under HF names in buckets of at most `cap` bytes (the layout of
  `protocol.plan_buckets`: pieces back to back, a plain tensor may be split over buckets as byte ranges, a folded
  weight never is). Each bucket is filled by ONE replay of a captured fold graph (`kernels.fold.GroupedFold`: every
  adapted weight of the bucket, W + s·B·A in fp32 rounded once, written straight into the bucket in HF layout —
  megatron's fused QKV is unfused by a row map in the same pass) plus one device copy per plain piece.
- `PipelinedSender` / `PipelinedReceiver` (wire/fast_receive.py): a ring of bucket buffers and three CUDA streams.
  The trainer packs bucket i+1 on a pack stream while bucket i is on the wire (NCCL's stream); the receiver applies
  bucket i into the engine's parameters on an apply stream while bucket i+1 arrives. Events order reuse of a buffer.
  The host only enqueues: nothing waits for the GPU until the final `ack`.
- `AdapterPack` (Adapter mode; adapter_pack.py): the HF-PEFT adapter as ONE gather (`index_select`) from the
  adapter's parameters laid end to end, into one flat buffer; `AdapterRing` on the engine side receives it into one
  of a ring of buffers whose tensor views were made once, and the new adapter object is registered — the engine
  serves it from the next request on, with no copy and no per-tensor work.
- `FlatDelta` (adapter_pack.py): the delta-skip decision as one fused max-abs-diff over the flat adapter and one
  all-reduce of one number (`delta.should_push`'s rule — collective MAX, never a per-rank return).
- Colocated (trainer and engine on the same GPU, SPEC's default deployment): the engine's memory is mapped by the
  trainer ONCE through CUDA IPC (`serialize.py` payloads exchanged at plan time), then a push writes straight into
  it. `ColocatedMerge` (colocated_merge.py): the engine's weights are the destination — one captured fold graph writes
  every adapted weight (W + s·B·A, megatron's fused QKV unfused by a row map into the engine's fused q;k;v buffer,
  see `fuse_rows`), one captured copy graph the frozen tensors (a full push; an incremental push skips them, the
  base is frozen). `AdapterPack.pack_into`: the adapter's one gather lands in the engine's next `AdapterRing` slot.
  Nothing is serialised, copied twice or re-opened per push: the engine only swaps its adapter object / version
  label when told.

Tensor parallelism (TP > 1, megatron): each trainer rank holds shards. A sharded `FoldEntry` (`tp_dim` set)
names the FULL HF tensors; every TP rank gathers its shard to TP rank 0 (`WeightUpdateGroup.gather` over the TP
group), rank 0 folds and broadcasts, the other ranks only gather (`PipelinedSender(plan, None, tp=...)`).
Row-sharded kinds (QKV, gate/up, vocab rows): rank t's rows of every output form ONE block of the bucket
(pieces are byte ranges of the HF tensors), so an unadapted shard is gathered straight into the bucket and an
adapted one is folded from the gathered shard into its block (the QKV row map is per rank). Column-sharded
kinds (o_proj, down_proj): the gathered shards are folded / copied into column slices of the HF tensor.
`AdapterPack` gathers the flat adapters and picks each HF tensor out of them with one `index_select`.

Metadata that a generic engine needs (names, dtypes, shapes, byte ranges per bucket) comes from
`MergePlan.buckets` in `protocol.Bucket` form, so an engine can also take these buckets through
`/update_weights_from_distributed` (load_format flattened_bucket). On CPU (gloo) the same classes run
sequentially without streams, which is what the CPU tests exercise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kora_trainer.kernels.fold import FoldItem, GroupedFold
from kora_trainer.wire.fast_receive import Streams, as_bytes, nbytes
from kora_trainer.wire.group import WeightUpdateGroup
from kora_trainer.wire.protocol import Bucket, Piece, dtype_name

Named = tuple[str, torch.Tensor]


@dataclass
class PlainEntry:
    """A tensor sent as it is, under `name` (may be split over buckets)."""

    name: str
    src: torch.Tensor  # contiguous


@dataclass
class FoldEntry:
    """One source weight W [M, N] folded (or, a is None, copied) into one or several consecutive HF tensors
    (their rows concatenated = M rows, placed by row_map). Never split over buckets.

    Sharded (`tp` > 1 and `tp_dim` set): `outs` are the FULL HF tensors, `w` / `a` / `b` / `row_map` this TP
    rank's. tp_dim 0: every output's rows are split evenly over the ranks and W's rows (after row_map) are
    [out_0's rows of this rank; out_1's; ...]; the sharded factor is B (A is replicated). tp_dim 1: one output
    whose columns are split (W_t [M, N/tp]); the sharded factor is A (B is replicated). An unadapted tp_dim 0
    entry without a row map may be split over buckets (by rows)."""

    outs: list[tuple[str, tuple[int, ...]]]  # HF names and shapes, in bucket order
    w: torch.Tensor
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    scale: float = 1.0
    row_map: torch.Tensor | None = None  # [M] int32: row of the concatenated outputs each W row goes to
    tp_dim: int | None = None  # None: replicated (or TP = 1); 0: rows sharded; 1: columns sharded
    tp: int = 1  # tensor-parallel size the shard belongs to

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    @property
    def sharded(self) -> bool:
        return self.tp > 1 and self.tp_dim is not None

    @property
    def factor(self) -> torch.Tensor | None:
        """The sharded LoRA factor (gathered with W): B for row-sharded kinds, A for column-sharded ones."""
        return self.b if self.tp_dim == 0 else self.a


Entry = PlainEntry | FoldEntry


def _align(n: int, to: int = 16) -> int:
    return -(-n // to) * to


@dataclass
class _BucketWork:
    copies: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (src bytes, bucket offset, n)
    folds: list[tuple[FoldEntry, int]] = field(default_factory=list)  # (entry, bucket offset)
    # TP > 1: (this rank's bytes, "bucket" | "scratch", offset, stride): rank t's bytes land at offset + t·stride
    gathers: list[tuple[torch.Tensor, str, int, int]] = field(default_factory=list)
    # TP > 1, on rank 0: (entry, bucket offset, scratch offset of W's shards, of the factor's shards or -1)
    tp_folds: list[tuple[FoldEntry, int, int, int]] = field(default_factory=list)
    scratch: int = 0  # bytes of gathered shards this bucket needs


class MergePlan:
    """Entries packed into buckets of at most `cap` bytes, in order (see the module docstring). Every TP rank
    builds the same plan from its own shards (same shapes, so the same buckets and gathers)."""

    def __init__(self, entries: Sequence[Entry], cap: int):
        if cap <= 0:
            raise ValueError("sync.bufferSize must be positive")
        self.cap = cap
        sizes = {e.tp for e in entries if isinstance(e, FoldEntry) and e.sharded}
        if len(sizes) > 1:
            raise ValueError(f"entries of different tensor parallel sizes {sorted(sizes)}")
        self.tp = sizes.pop() if sizes else 1
        self.buckets: list[Bucket] = [Bucket()]
        self.work: list[_BucketWork] = [_BucketWork()]
        for e in entries:
            if isinstance(e, FoldEntry) and e.sharded:
                self._sharded(e)
            elif isinstance(e, FoldEntry):
                self._folded(e)
            else:
                self._plain(e)
        if not self.buckets[-1].pieces:
            self.buckets.pop()
            self.work.pop()

    def _folded(self, e: FoldEntry) -> None:
        """A folded (or copied) weight: never split, so a bucket of its own where it does not fit."""
        cap = self.cap
        if e.nbytes > cap:
            raise ValueError(f"{e.outs[0][0]}: a folded weight of {e.nbytes} bytes does not fit in "
                             f"sync.bufferSize {cap}")
        if self.buckets[-1].nbytes + e.nbytes > cap:
            self._new()
        self.work[-1].folds.append((e, self.buckets[-1].nbytes))
        for name, shape in e.outs:
            n = nbytes(shape, e.dtype)
            self.buckets[-1].pieces.append(Piece(name, dtype_name(e.dtype), tuple(shape), 0, n))

    def _plain(self, e: PlainEntry) -> None:
        """A plain tensor: split over buckets as byte ranges where it does not fit."""
        cap = self.cap
        src = as_bytes(e.src)
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

    def _new(self) -> None:
        self.buckets.append(Bucket())
        self.work.append(_BucketWork())

    def _rank_pieces(self, e: FoldEntry, t: int, r0: int, r1: int) -> list[Piece]:
        """Rows [r0, r1) of rank t's block of a row-sharded entry as byte ranges of the HF outputs."""
        pieces, first = [], 0
        for name, shape in e.outs:
            rows = shape[0] // self.tp
            row_bytes = nbytes(shape[1:], e.dtype)
            lo, hi = max(r0, first), min(r1, first + rows)
            if lo < hi:
                start = (t * rows + lo - first) * row_bytes
                pieces.append(Piece(name, dtype_name(e.dtype), tuple(shape), start, start + (hi - lo) * row_bytes))
            first += rows
        return pieces

    def _scratch(self, work: _BucketWork, n: int) -> tuple[int, int]:
        """Room for every rank's n bytes in the gather scratch: (offset, stride), 16-byte aligned."""
        off, stride = _align(work.scratch), _align(n)
        work.scratch = off + self.tp * stride
        return off, stride

    def _check_shards(self, e: FoldEntry) -> None:
        """A sharded entry's outputs must be `tp` row shards (tp_dim 0) or column shards (tp_dim 1) of its W."""
        tp, name = self.tp, e.outs[0][0]
        if e.tp_dim == 0:
            rows = [shape[0] for _, shape in e.outs]
            if any(r % tp for r in rows) or sum(r // tp for r in rows) != e.w.shape[0] or \
                    any(nbytes(shape[1:], e.dtype) != nbytes(e.w.shape[1:], e.dtype) for _, shape in e.outs):
                raise ValueError(f"{name}: outputs {[s for _, s in e.outs]} are not {tp} row shards like "
                                 f"{tuple(e.w.shape)}")
        elif e.tp_dim == 1:
            if len(e.outs) != 1 or tuple(e.outs[0][1]) != (e.w.shape[0], e.w.shape[1] * tp):
                raise ValueError(f"{name}: {[s for _, s in e.outs]} is not {tp} column shards of {tuple(e.w.shape)}")
        else:
            raise ValueError(f"{name}: tp_dim {e.tp_dim}")

    def _row_copy(self, e: FoldEntry) -> None:
        """A plain row-sharded copy: every rank's rows straight into the bucket, split by rows when large."""
        tp, name = self.tp, e.outs[0][0]
        src, m = as_bytes(e.w), e.w.shape[0]
        row_bytes = e.nbytes // m if m else 0
        r = 0
        while r < m:
            fit = (self.cap - self.buckets[-1].nbytes) // (tp * row_bytes)
            if fit == 0:
                if not self.buckets[-1].pieces:
                    raise ValueError(f"{name}: one row from each of {tp} ranks ({tp * row_bytes} bytes) does "
                                     f"not fit in sync.bufferSize {self.cap}")
                self._new()
                continue
            r1 = min(m, r + fit)
            n = (r1 - r) * row_bytes
            self.work[-1].gathers.append((src[r * row_bytes:r1 * row_bytes], "bucket", self.buckets[-1].nbytes, n))
            for t in range(tp):
                self.buckets[-1].pieces += self._rank_pieces(e, t, r, r1)
            r = r1

    def _sharded(self, e: FoldEntry) -> None:
        self._check_shards(e)
        if e.tp_dim == 0 and e.a is None and e.row_map is None:
            self._row_copy(e)
            return
        tp, name = self.tp, e.outs[0][0]
        full = tp * e.nbytes
        if full > self.cap:
            raise ValueError(f"{name}: a sharded weight of {full} bytes (all {tp} shards) does not fit in "
                             f"sync.bufferSize {self.cap}")
        if self.buckets[-1].nbytes + full > self.cap:
            self._new()
        work, off = self.work[-1], self.buckets[-1].nbytes
        w_off, w_stride = self._scratch(work, e.nbytes)
        work.gathers.append((as_bytes(e.w), "scratch", w_off, w_stride))
        f_off = -1
        if e.a is not None:
            f = e.factor
            assert f is not None and e.b is not None
            f_off, f_stride = self._scratch(work, f.numel() * f.element_size())
            work.gathers.append((as_bytes(f), "scratch", f_off, f_stride))
        work.tp_folds.append((e, off, w_off, f_off))
        if e.tp_dim == 0:
            for t in range(tp):
                self.buckets[-1].pieces += self._rank_pieces(e, t, 0, e.w.shape[0])
        else:
            self.buckets[-1].pieces.append(Piece(name, dtype_name(e.dtype), tuple(e.outs[0][1]), 0, full))

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def metadata(self) -> list[dict[str, list[Any]]]:
        return [b.metadata() for b in self.buckets]


def _leader_and_device(plan: MergePlan, group: WeightUpdateGroup | None, tp: WeightUpdateGroup | None
                       ) -> tuple[bool, torch.device]:
    """Whether this rank is TP rank 0 (the one that folds and broadcasts) and the device the push runs on."""
    tp_size = tp.world_size if tp is not None else 1
    if tp_size != plan.tp:
        raise ValueError(f"the plan is for tensor parallel size {plan.tp}, the TP group given has {tp_size} ranks")
    leader = tp is None or tp.rank == 0
    if leader and group is None:
        raise ValueError("TP rank 0 needs the weight-update group")
    device = group.device if group is not None else tp.device if tp is not None else None
    assert device is not None
    return leader, device


class PipelinedSender:
    """Trainer rank 0: fill (fold + copy) bucket i+1 while bucket i is broadcast. `push()` only enqueues.

    TP > 1 (`plan.tp`): every TP rank makes one with `tp` (the TP group, `WeightUpdateGroup.wrap`) and calls
    `push()` for every push; TP rank 0 passes the weight-update `group`, the others None and only gather their
    shards to rank 0 (no buckets, no folds)."""

    def __init__(self, plan: MergePlan, group: WeightUpdateGroup | None, slots: int = 2,
                 fold_kw: dict[str, Any] | None = None, tp: WeightUpdateGroup | None = None):
        self.plan, self.group, self.slots = plan, group, slots
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.leader, self.device = _leader_and_device(plan, group, self.tp)
        self.buffers: list[torch.Tensor] = []
        self.scratch = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.folds: list[GroupedFold] = []
        self.streams = Streams(self.device, slots, len(plan.buckets))
        if self.leader:
            self._allocate(fold_kw)

    def _allocate(self, fold_kw: dict[str, Any] | None) -> None:
        """TP rank 0: the ring of bucket buffers, the gather scratch and every bucket's fold graph."""
        plan = self.plan
        size = max((b.nbytes for b in plan.buckets), default=0)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(self.slots)]
        self.scratch = torch.empty(max((w.scratch for w in plan.work), default=0), dtype=torch.uint8,
                                   device=self.device)
        self.folds = [GroupedFold(self._items(i), **(fold_kw or {})) for i in range(len(plan.work))]
        if self.device.type == "cuda":  # compile + capture now, before any collective is in flight
            for f in self.folds:
                f.prepare()

    def _items(self, i: int) -> list[FoldItem]:
        """Bucket i's folds (or copies) into its ring buffer: rank 0's own, then every rank's gathered shards."""
        work, buf = self.plan.work[i], self.buffers[i % self.slots]
        items = []
        for e, off in work.folds:
            out = buf[off:off + e.nbytes].view(e.dtype).view(e.w.shape)
            items.append(FoldItem(e.w, out, e.a, e.b, e.scale, e.row_map))
        for e, off, w_off, f_off in work.tp_folds:
            items += self._shard_items(e, buf, off, w_off, f_off)
        return items

    def _shard_items(self, e: FoldEntry, buf: torch.Tensor, off: int, w_off: int, f_off: int) -> list[FoldItem]:
        """Rank 0's folds (or copies) of every rank's gathered shard into the entry's place in the bucket."""
        tp = self.plan.tp
        w_stride = _align(e.nbytes)

        def shard(t: torch.Tensor, base: int, r: int) -> torch.Tensor:
            n = t.numel() * t.element_size()
            start = base + r * _align(n)
            return self.scratch[start:start + n].view(t.dtype).view(t.shape)

        items = []
        for r in range(tp):
            w = self.scratch[w_off + r * w_stride:w_off + r * w_stride + e.nbytes].view(e.dtype).view(e.w.shape)
            a, b = e.a, e.b
            if e.a is not None and e.b is not None:
                if e.tp_dim == 0:
                    b = shard(e.b, f_off, r)
                else:
                    a = shard(e.a, f_off, r)
            if e.tp_dim == 0:  # rank r's block of rows
                out = buf[off + r * e.nbytes:off + (r + 1) * e.nbytes].view(e.dtype).view(e.w.shape)
            else:  # rank r's columns of the full [M, N] tensor
                m, n = e.w.shape
                out = buf[off:off + tp * e.nbytes].view(e.dtype).view(m, tp * n)[:, r * n:(r + 1) * n]
            items.append(FoldItem(w, out, a, b, e.scale, e.row_map))
        return items

    def _gather(self, i: int) -> None:
        """Every TP rank's shards of bucket i to rank 0 (its buffer / the scratch); the other ranks send."""
        if self.tp is None:
            return
        buf = self.buffers[i % self.slots] if self.leader else None
        for src, where, off, stride in self.plan.work[i].gathers:
            outs = None
            if buf is not None:
                dst = buf if where == "bucket" else self.scratch
                n = src.numel()
                outs = [dst[off + r * stride:off + r * stride + n] for r in range(self.tp.world_size)]
            self.tp.gather(src, outs)

    def fill(self, i: int) -> torch.Tensor:
        """Bucket i's bytes into its ring buffer (on the current stream); returns the buffer slice. TP > 1: the
        shards are gathered first (every TP rank calls it; on ranks other than 0 only the gather, returns an
        empty tensor)."""
        self._gather(i)
        if not self.leader:
            return self.scratch
        buf = self.buffers[i % self.slots]
        self.folds[i]()
        for src, off, n in self.plan.work[i].copies:
            buf[off:off + n].copy_(src)
        return buf[:self.plan.buckets[i].nbytes]

    def push(self) -> None:
        s = self.streams
        if not self.leader:  # a TP rank other than 0: its shards, bucket by bucket, to rank 0
            for i in range(len(self.plan.buckets)):
                self.fill(i)
            return
        assert self.group is not None
        if not s.cuda:
            for i in range(len(self.plan.buckets)):
                self.group.broadcast(self.fill(i), src=0)
            return
        assert s.work is not None and s.comm is not None  # Streams makes both on CUDA
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


# ---- Adapter mode ----------------------------------------------------------------------------------------

@dataclass
class GatherSpec:
    """One HF-PEFT tensor = rows `rows` (None: all) of the 2-D adapter parameter `src`. Under TP, `src` is this
    rank's shard of a parameter whose full tensor is the TP ranks' shards concatenated along `split` (None:
    replicated; rank 0's copy is used) and `rows` index the full tensor."""

    name: str
    src: torch.Tensor
    rows: torch.Tensor | None = None  # int64 [rows of the output]
    split: int | None = None  # 0: rows sharded over the TP ranks, 1: columns sharded

    def full_shape(self, tp: int = 1) -> tuple[int, int]:
        m, n = self.src.shape
        m, n = (m * tp, n) if self.split == 0 else (m, n * tp) if self.split == 1 else (m, n)
        return (m if self.rows is None else int(self.rows.numel()), n)

    @property
    def shape(self) -> tuple[int, int]:
        return self.full_shape()


# ---- Colocated: trainer and engine on the same GPU, the engine's memory mapped once (CUDA IPC) ---------------
