"""Fused LoRA fold: out = round(W + s·B·A), accumulated in fp32 and rounded once.

Merge-mode sync folds every adapted weight every step, so the fold must run at memory speed:
it reads W once and writes the result once (the rank-r product is recomputed per tile, which
costs far less than a trip through memory). torch.addmm materialises W in fp32 first (~0.08x of
device-copy bandwidth on an H200); these kernels stream tiles.

- `fold(w, a, b, scale, out=)`: one tensor, one launch.
- `GroupedFold(items)`: a fixed list of folds (and plain row-mapped copies) launched together: by default
  the per-tensor launches captured ONCE in a CUDA graph over parallel branches and replayed per push
  (0.79x of one device copy for Qwen3-4B's 72 adapted weights on an H200, 2026-11-30; per-tensor launches
  from Python: 0.57x; a single grouped launch over every tile: 0.25x).
- `row_map` (int32 [M]): output row of each input row. Merge sync uses it to write megatron's
  fused, group-interleaved QKV straight into HF's q, k, v order inside the sync bucket.

Factors: bf16/fp16 factors go to the tensor cores as they are (their products are exact in fp32,
accumulated in fp32: the same numbers as converting first). fp32 factors use the 3-pass tf32 split
(fp32 accuracy) by default, or plain CUDA-core FMAs (`fma=True`: exact fp32).
Measured numbers: bench/results/gpu_sync_*.json, docs/megatron_backend.md.

`out` may be W itself (in place; only without a row map), a slice of a flat sync bucket, or a fresh
tensor. On CPU (or without Triton) the same entry points run a torch reference with the same rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def fold_reference(
    w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """W[out, in] + scale · B[out, r] @ A[r, in], in fp32, rounded once to W's dtype."""
    result = torch.addmm(w.float(), b.float(), a.float(), alpha=scale).to(w.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


if triton is not None:
    # Triton kernels: triton.jit is untyped and a kernel's parameters are Triton values whose annotations
    # (tl.constexpr) Triton itself reads, so they stay unannotated for mypy (the ignores below)

    @triton.jit  # type: ignore[untyped-decorator]
    def _fold_tile(  # type: ignore[no-untyped-def]
        w_ptr, a_ptr, b_ptr, o_ptr, map_ptr, M, N, r, scale, stride_w, stride_o, pid_m, pid_n, map_flag,
        R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
        HAS_LORA: tl.constexpr, MAP_MODE: tl.constexpr, NATIVE_DOT: tl.constexpr, FMA: tl.constexpr,
        BIG: tl.constexpr,
    ):
        """One [BLOCK_M, BLOCK_N] tile: load W first (its latency overlaps the rank-r product), add, store."""
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of W (out features)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # cols of W (in features)
        rn = tl.max_contiguous(tl.multiple_of(rn, BLOCK_N), BLOCK_N)
        mask_m, mask_n = rm < M, rn < N
        mask = mask_m[:, None] & mask_n[None, :]
        w_rows = rm[:, None].to(tl.int64) if BIG else rm[:, None]  # int64 offsets only for >= 2^31 elements
        w = tl.load(w_ptr + w_rows * stride_w + rn[None, :], mask=mask, other=0.0)
        acc = w.to(tl.float32)
        if HAS_LORA:
            if FMA:  # exact fp32 on the CUDA cores: r rank-1 updates, factors read from L1/L2
                delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k in tl.static_range(R):
                    bk = tl.load(b_ptr + rm * r + k, mask=mask_m & (rm * 0 + k < r), other=0.0).to(tl.float32)
                    ak = tl.load(a_ptr + k * N + rn, mask=mask_n & (rn * 0 + k < r), other=0.0).to(tl.float32)
                    delta += bk[:, None] * ak[None, :]
            else:
                rr = tl.arange(0, R)
                mask_r = rr < r  # the rank padded to a power of two >= 16 with zeros (exact)
                b = tl.load(b_ptr + rm[:, None] * r + rr[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
                a = tl.load(a_ptr + rr[:, None] * N + rn[None, :], mask=mask_r[:, None] & mask_n[None, :], other=0.0)
                if NATIVE_DOT:  # bf16 / fp16 factors: exact products, fp32 accumulation
                    delta = tl.dot(b, a)
                else:
                    delta = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision=PRECISION)
            acc = acc + scale * delta
        rows = rm
        if MAP_MODE == 1:  # block-contiguous map: the tile's rows stay together, only the block moves
            row0 = tl.load(map_ptr + tl.where(map_flag >= 0, pid_m * BLOCK_M, 0))
            rows = tl.where(map_flag >= 0, row0 + tl.arange(0, BLOCK_M), rm)
        if MAP_MODE == 2:  # any permutation of rows
            use_map = (rm * 0 + map_flag) >= 0  # map_flag < 0: this item has no row map
            mapped = tl.load(map_ptr + rm, mask=mask_m & use_map, other=0)
            rows = tl.where(use_map, mapped, rm)
        o_rows = rows[:, None].to(tl.int64) if BIG else rows[:, None]
        tl.store(o_ptr + o_rows * stride_o + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def _fold_kernel(  # type: ignore[no-untyped-def]
        w_ptr, a_ptr, b_ptr, o_ptr, map_ptr, M, N, r, scale, stride_w, stride_o,
        R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
        HAS_LORA: tl.constexpr, MAP_MODE: tl.constexpr, NATIVE_DOT: tl.constexpr, FMA: tl.constexpr,
        BIG: tl.constexpr,
    ):
        _fold_tile(w_ptr, a_ptr, b_ptr, o_ptr, map_ptr, M, N, r, scale, stride_w, stride_o,
                   tl.program_id(0), tl.program_id(1), 0, R, BLOCK_M, BLOCK_N, PRECISION,
                   HAS_LORA, MAP_MODE, NATIVE_DOT, FMA, BIG)

    @triton.jit  # type: ignore[untyped-decorator]
    def _fold_group_kernel(  # type: ignore[no-untyped-def]
        w_base, a_base, b_base, o_base, map_base, meta, scales, tile_item, r,
        R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
        HAS_LORA: tl.constexpr, MAP_MODE: tl.constexpr, NATIVE_DOT: tl.constexpr, FMA: tl.constexpr,
        BIG: tl.constexpr,
        ALIGN: tl.constexpr,
    ):
        """Every tile of every item in one grid. meta (int64, 11 per item): element offsets of W, A, B, out and
        row map from their base pointers (map -1: identity), M, N, W row stride, out row stride, first tile,
        tiles along N. Offsets and strides are multiples of ALIGN elements (16 bytes): vector loads/stores."""
        pid = tl.program_id(0)
        t = tl.load(tile_item + pid)
        row = meta + t * 11
        w_off = tl.multiple_of(tl.load(row + 0), ALIGN)
        a_off = tl.load(row + 1)
        b_off = tl.load(row + 2)
        o_off = tl.multiple_of(tl.load(row + 3), ALIGN)
        map_off = tl.load(row + 4)
        M = tl.load(row + 5)
        N = tl.load(row + 6)
        stride_w = tl.load(row + 7)
        stride_o = tl.load(row + 8)
        if not BIG:  # 32-bit index arithmetic inside a tensor
            M, N, stride_w, stride_o = M.to(tl.int32), N.to(tl.int32), stride_w.to(tl.int32), stride_o.to(tl.int32)
        stride_w = tl.multiple_of(stride_w, ALIGN)
        stride_o = tl.multiple_of(stride_o, ALIGN)
        local = pid - tl.load(row + 9)
        tiles_n = tl.load(row + 10)
        scale = tl.load(scales + t)
        _fold_tile(w_base + w_off, a_base + a_off, b_base + b_off, o_base + o_off,
                   map_base + tl.maximum(map_off, 0), M, N, r, scale, stride_w, stride_o,
                   local // tiles_n, local % tiles_n, map_off, R, BLOCK_M, BLOCK_N, PRECISION,
                   HAS_LORA, MAP_MODE, NATIVE_DOT, FMA, BIG)


def map_mode(row_map: torch.Tensor, block_m: int) -> int:
    """1 if every BLOCK_M-row block of the map is consecutive rows (the tile moves as a whole: QKV's head
    blocks with block_m dividing head_dim), else 2 (row by row)."""
    rm = row_map.detach().long().cpu()
    idx = torch.arange(rm.numel())
    return 1 if torch.equal(rm, rm[(idx // block_m) * block_m] + idx % block_m) else 2


def _big(*ts: torch.Tensor) -> bool:
    return any(t.numel() >= 2**31 - 1 or t.stride(0) * t.shape[0] >= 2**31 - 1 for t in ts)


def _rank_pad(r: int) -> int:
    return max(16, 1 << max(r - 1, 0).bit_length())


def _precision(a: torch.Tensor, b: torch.Tensor, precision: str | None) -> tuple[bool, str]:
    """(native tensor-core dot?, tl.dot input precision for fp32 factors)."""
    native = a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype
    return native, precision or "tf32x3"


def fold(
    w: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    row_map: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    precision: str | None = None,
    fma: bool = False,
) -> torch.Tensor:
    """Fused fold on CUDA (Triton), torch reference elsewhere. Shapes: w [M, N], a [r, N], b [M, r].

    row_map [M] (int): out[row_map[i]] = fold(W)[i] (out must not alias W then)."""
    m, n = w.shape
    r = a.shape[0]
    if b.shape != (m, r) or a.shape[1] != n:
        raise ValueError(f"fold: W {tuple(w.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)} do not line up")
    if out is None:
        out = torch.empty_like(w)
    # fp32 factors beyond rank 64 exceeded one bf16 ulp against addmm in the 3-pass tf32 path on the H200 run
    # of 2026-11-30 (tests/unit/test_fold_kernel.py, r = 128): the torch path until that is understood
    slow = a.dtype == torch.float32 and _rank_pad(r) > 64
    if triton is None or not w.is_cuda or slow:
        if row_map is None:
            return fold_reference(w, a, b, scale, out)
        out.index_copy_(0, row_map.long(), fold_reference(w, a, b, scale))
        return out
    if m == 0 or n == 0:
        return out
    a, b = a.contiguous(), b.contiguous()
    w_c = w if w.stride(1) == 1 else w.contiguous()
    if out.stride(1) != 1:
        raise ValueError("fold: out must have unit stride along its last dimension")
    native, prec = _precision(a, b, precision)
    if block_n is None:  # keep the A tile [R, BLOCK_N] small for large ranks (fp32 r = 128 went wrong at 128)
        block_n = 128 if _rank_pad(r) <= 64 else 64
    rmap = row_map.to(torch.int32) if row_map is not None else w_c  # any pointer when unused
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fold_kernel[grid](
        w_c, a, b, out, rmap, m, n, r, float(scale), w_c.stride(0), out.stride(0),
        R=_rank_pad(r), BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=prec, HAS_LORA=True,
        MAP_MODE=0 if row_map is None else map_mode(row_map, block_m), NATIVE_DOT=native and not fma, FMA=fma,
        BIG=_big(w_c, out),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


@dataclass
class FoldItem:
    """out[row_map[i]] = round(W[i] + scale · (B A)[i]) — or a plain (row-mapped) copy when a is None."""

    w: torch.Tensor  # [M, N], unit stride along N
    out: torch.Tensor  # [M, N] (rows placed by row_map), unit stride along N
    a: torch.Tensor | None = None  # [r, N] contiguous
    b: torch.Tensor | None = None  # [M, r] contiguous
    scale: float = 1.0
    row_map: torch.Tensor | None = None  # [M] int32 on W's device

    def reference(self) -> None:
        """The torch path (CPU, or any item the grouped kernel cannot take)."""
        src = self.w if self.a is None or self.b is None else fold_reference(self.w, self.a, self.b, self.scale)
        if self.row_map is None:
            self.out.copy_(src)
        else:
            self.out.index_copy_(0, self.row_map.long(), src.to(self.out.dtype))


class GroupedFold:
    """A fixed list of FoldItems, launched together. Two ways (`launch`):

    - "graph" (default on CUDA): one `_fold_kernel` launch per item, captured ONCE into a CUDA graph whose
      launches are spread over `streams` parallel branches, so one item's tail overlaps the next item's
      start and Python's per-launch cost is paid at capture only. `__call__` is one graph replay.
    - "grouped": one `_fold_group_kernel` launch per (W dtype, out dtype, factor dtype, rank) group, every
      tile of every item in one grid (tables of element offsets from one base pointer per role). Measured
      slower on H200 (bench/results/gpu_sync_*.json: the per-tile chain of dependent metadata loads).

    The tensors must stay allocated at the same addresses (parameters and persistent sync buckets do).
    Items the kernels cannot take (misaligned, strided) and every item on CPU run the torch reference.
    """

    def __init__(self, items: Sequence[FoldItem], block_m: int = 64, block_n: int = 128, num_warps: int = 4,
                 num_stages: int = 2, precision: str | None = None, fma: bool = False,
                 map_modes: bool = True, launch: str = "graph", streams: int = 4):
        self.items = list(items)
        self.launch, self.streams = launch, streams
        self.graph: torch.cuda.CUDAGraph | None = None
        self.singles: list[FoldItem] = []
        self._modes: list[int] = []  # row-map mode per single (decided here: no host reads during capture)
        self.map_modes = map_modes  # False: row by row even where blocks would do (for measurements)
        self.cfg = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        self.precision, self.fma = precision, fma
        self.fallback: list[FoldItem] = []
        self.launches: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        groups: dict[tuple[Any, ...], list[FoldItem]] = {}
        for it in self.items:
            if it.w.numel() == 0:
                continue
            if triton is None or not it.w.is_cuda or not self._aligned(it):
                self.fallback.append(it)
                continue
            if launch == "graph":
                self.singles.append(it)
                self._modes.append(0 if it.row_map is None else (map_mode(it.row_map, block_m) if map_modes else 2))
                continue
            if it.a is not None and it.b is not None:  # a LoRA fold
                key: tuple[Any, ...] = (it.w.dtype, it.out.dtype, it.a.dtype, it.a.shape[0])
            else:
                key = (it.w.dtype, it.out.dtype, None, 0)
            groups.setdefault(key, []).append(it)
        for key, group in groups.items():
            self.launches.append(self._tables(key, group))

    @staticmethod
    def _aligned(it: FoldItem) -> bool:
        ok = it.w.dim() == 2 and it.w.stride(1) == 1 and it.out.stride(1) == 1 and it.out.shape == it.w.shape
        ok = ok and (it.row_map is None or it.row_map.dtype == torch.int32)
        if it.a is not None and it.b is not None:
            ok = ok and it.a.is_contiguous() and it.b.is_contiguous() and it.a.dtype == it.b.dtype
        align = 16
        return ok and all(x % align == 0 for x in (it.w.data_ptr(), it.out.data_ptr(),
                                                   it.w.stride(0) * it.w.element_size(),
                                                   it.out.stride(0) * it.out.element_size()))

    def _tables(self, key: tuple[Any, ...], group: list[FoldItem]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        wdt, odt, adt, r = key
        bm, bn = self.cfg["block_m"], self.cfg["block_n"]
        dev = group[0].w.device
        lora = adt is not None
        # the factors in item order (with `lora` every item of the group has both)
        fa = [it.a for it in group if it.a is not None]
        fb = [it.b for it in group if it.b is not None]
        bases = {
            "w": min(group, key=lambda i: i.w.data_ptr()).w,
            "o": min(group, key=lambda i: i.out.data_ptr()).out,
            "a": min(fa, key=lambda t: t.data_ptr()) if lora else group[0].w,
            "b": min(fb, key=lambda t: t.data_ptr()) if lora else group[0].w,
        }
        maps = [it.row_map for it in group if it.row_map is not None]
        mode = 0
        if maps:
            mode = max(map_mode(m, bm) for m in {id(m): m for m in maps}.values()) if self.map_modes else 2
        map_base = min(maps, key=lambda m: m.data_ptr()) if maps else torch.zeros(1, dtype=torch.int32, device=dev)

        def off(t: torch.Tensor | None, base: torch.Tensor) -> int:
            if t is None:
                return -1
            diff = t.data_ptr() - base.data_ptr()
            assert diff % t.element_size() == 0
            return diff // t.element_size()

        rows, scales, tile_item = [], [], []
        first = 0
        for i, it in enumerate(group):
            m, n = it.w.shape
            tm, tn = -(-m // bm), -(-n // bn)
            rows.append([off(it.w, bases["w"]), off(it.a, bases["a"]) if lora else 0,
                         off(it.b, bases["b"]) if lora else 0, off(it.out, bases["o"]),
                         off(it.row_map, map_base), m, n, it.w.stride(0), it.out.stride(0), first, tn])
            scales.append(float(it.scale))
            tile_item.append(torch.full((tm * tn,), i, dtype=torch.int32))
            first += tm * tn
        meta = torch.tensor(rows, dtype=torch.int64, device=dev).reshape(-1)
        native, prec = (_precision(fa[0], fb[0], self.precision) if lora else (False, "tf32x3"))
        args = (bases["w"], bases["a"], bases["b"], bases["o"], map_base, meta,
                torch.tensor(scales, dtype=torch.float32, device=dev), torch.cat(tile_item).to(dev), max(r, 1))
        big = any(_big(it.w, it.out) for it in group)
        kw = dict(R=_rank_pad(r), BLOCK_M=bm, BLOCK_N=bn, PRECISION=prec, HAS_LORA=lora, MAP_MODE=mode, BIG=big,
                  NATIVE_DOT=native and not self.fma, FMA=self.fma and lora, ALIGN=16 // wdt.itemsize if
                  wdt.itemsize == odt.itemsize else 1,
                  num_warps=self.cfg["num_warps"], num_stages=self.cfg["num_stages"], grid=(first,))
        return args, kw

    def _launch_single(self, it: FoldItem, mode: int) -> None:
        m, n = it.w.shape
        bm, bn = self.cfg["block_m"], self.cfg["block_n"]
        if it.a is not None and it.b is not None:
            lora, a, b, r = True, it.a, it.b, it.a.shape[0]
        else:
            lora, a, b, r = False, it.w, it.w, 1
        native, prec = _precision(a, b, self.precision) if lora else (False, "tf32x3")
        _fold_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            it.w, a, b, it.out, it.row_map if it.row_map is not None else it.w, m, n, r, float(it.scale),
            it.w.stride(0), it.out.stride(0), R=_rank_pad(r), BLOCK_M=bm, BLOCK_N=bn, PRECISION=prec,
            HAS_LORA=lora, MAP_MODE=mode, NATIVE_DOT=native and not self.fma, FMA=self.fma and lora,
            BIG=_big(it.w, it.out), num_warps=self.cfg["num_warps"], num_stages=self.cfg["num_stages"])

    def prepare(self) -> None:
        """Compile and capture now (the graph mode captures on first use otherwise). Capture while no other
        stream of this process is busy: call it before a push starts."""
        if not self.singles or self.graph is not None:
            return
        dev = self.singles[0].w.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for it, mode in zip(self.singles, self._modes, strict=True):  # compile outside the capture
                self._launch_single(it, mode)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        branches = [torch.cuda.Stream(dev) for _ in range(max(1, self.streams))]
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream(dev)
        with torch.cuda.graph(graph, stream=capture, capture_error_mode="thread_local"):
            fork = torch.cuda.Event()
            fork.record(capture)
            for s in branches:
                s.wait_event(fork)
            for i, (it, mode) in enumerate(zip(self.singles, self._modes, strict=True)):
                with torch.cuda.stream(branches[i % len(branches)]):
                    self._launch_single(it, mode)
            for s in branches:
                join = torch.cuda.Event()
                join.record(s)
                capture.wait_event(join)
        graph.replay()  # the first launch uploads the graph: here, not in the first push (the launches above wrote
        torch.cuda.synchronize(dev)  # the same outputs)
        self.graph = graph

    def __call__(self) -> None:
        if self.singles:
            self.prepare()
            assert self.graph is not None
            self.graph.replay()
        for args, kw in self.launches:
            grid = kw["grid"]
            _fold_group_kernel[grid](*args, **{k: v for k, v in kw.items() if k != "grid"})
        for it in self.fallback:
            it.reference()
