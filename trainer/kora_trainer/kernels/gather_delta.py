"""The delta decision and the ring slot's gather in one pass over the adapter (colocated pushes, issue 17).

Before a colocated push the trainer decides whether the adapter moved since the last push (max |now − last
pushed|, in fp32: `sync.fastPath`'s delta-skip) and, in Adapter and EngineMerge mode, gathers the HF tensors into
the engine's ring slot. In torch that is a copy to fp32, a subtraction and an abs-max reduction (each a pass over
fp32 temporaries as large as the adapter) and an index_select whose int32 index is itself twice a bf16 adapter's
bytes. `gather_max_delta` reads the source, the index and the last pushed values once, writes the slot once and
leaves one number, in one launch.

- `index` (int32 or int64, or None for the identity) with `run`: output elements i*run .. i*run+run-1 are
  `src[index[i]]` .. `src[index[i]+run-1]` (`runs_of` finds the longest such run an element index allows: an
  adapter's rows are contiguous, so the index shrinks by a row's length and stops being the largest read).
- `last`: what was pushed, element by element in the output's order, fp32 or the source's own dtype (the
  previous ring slot: a bf16 value's difference with another is exact in fp32 either way).
- The number is max_i |float(src[index[i]]) − float(last[i])|, a NaN counted as +inf: a NaN in the adapter is
  pushed (the engines then serve what the trainer trains), where a NaN maximum compares False against the
  threshold.

On CPU (or without Triton) the same entry points run torch, with the same numbers: a difference of two fp32 values
and its absolute value are exact operations in either, and a maximum does not depend on the order.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

BLOCK = 4096  # elements per program: 8 KiB of a bf16 source, few enough atomics on the one result word


def runs_of(index: torch.Tensor, longest: int = 64) -> tuple[torch.Tensor, int]:
    """(`starts`, `run`): the largest power of two `run` <= `longest` such that `index` is `starts` expanded to runs
    of `run` consecutive elements (run 1: the index itself). Once, at plan time."""
    run = longest
    while run > 1:
        if index.numel() % run == 0:
            rows = index.view(-1, run)
            steps = torch.arange(run, device=index.device, dtype=index.dtype)
            if bool((rows == rows[:, :1] + steps).all()):
                return rows[:, 0].contiguous(), run
        run //= 2
    return index, 1


def gather_max_delta(src: torch.Tensor, index: torch.Tensor | None, last: torch.Tensor, result: torch.Tensor,
                     out: torch.Tensor | None = None, run: int = 1) -> None:
    """result[0] = max_i |float(src[index[i]]) − float(last[i])| (NaN: +inf; 0 for no elements) and, given `out`,
    out[i] = src[index[i]] (cast to out's dtype); `index` in runs of `run` (see the module docstring). Enqueued on
    the current stream; nothing is read back, so it can be captured in a CUDA graph. `result`: fp32 [1]."""
    n = last.numel()
    _check(src, index, last, n, out, run)
    if result.dtype != torch.float32 or result.numel() != 1:
        raise ValueError("gather_max_delta: the result is one fp32 number")
    if triton is None or not src.is_cuda:
        values = _gathered(src, index, run)
        if out is not None:
            out.copy_(values)
        d = (values.float() - last.float()).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
        result.copy_(d.max().reshape(1) if n else torch.zeros(1, device=result.device))
        return
    result.zero_()
    _launch(src, index, last, out, result, n, run)


def gather(src: torch.Tensor, index: torch.Tensor | None, out: torch.Tensor, run: int = 1) -> None:
    """out[i] = src[index[i]], cast to out's dtype (e.g. the fp32 `last` of what was just pushed)."""
    n = out.numel()
    _check(src, index, None, n, out, run)
    if triton is None or not src.is_cuda:
        out.copy_(_gathered(src, index, run))
        return
    _launch(src, index, None, out, None, n, run)


def _gathered(src: torch.Tensor, index: torch.Tensor | None, run: int) -> torch.Tensor:
    if index is None:
        return src
    full = index.long() if run == 1 else (index.long().unsqueeze(1) + torch.arange(run, device=index.device)).view(-1)
    return src.index_select(0, full)


def _check(src: torch.Tensor, index: torch.Tensor | None, last: torch.Tensor | None, n: int,
           out: torch.Tensor | None, run: int) -> None:
    if src.dim() != 1 or not src.is_contiguous():
        raise ValueError("gather_max_delta: the source is one flat contiguous tensor")
    if index is None and src.numel() != n:
        raise ValueError(f"gather_max_delta: without an index the source ({src.numel()}) and the output ({n}) "
                         f"have one length")
    if run < 1 or BLOCK % run:
        raise ValueError(f"gather_max_delta: a run of {run} elements does not divide a block of {BLOCK}")
    if index is not None and (index.numel() * run != n or index.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"gather_max_delta: the index is int32/int64 with one entry per run of {run} of the "
                         f"output's {n} elements")
    if last is not None and (not last.is_floating_point() or not last.is_contiguous()):
        raise ValueError("gather_max_delta: the last pushed values are one contiguous float tensor")
    if out is not None and (out.numel() != n or not out.is_contiguous()):
        raise ValueError(f"gather_max_delta: the output is contiguous with {n} elements")


def _launch(src: torch.Tensor, index: torch.Tensor | None, last: torch.Tensor | None, out: torch.Tensor | None,
            result: torch.Tensor | None, n: int, run: int = 1) -> None:
    if not n:
        return
    _gather_max_delta_kernel[(triton.cdiv(n, BLOCK),)](
        src, index if index is not None else src, last if last is not None else src,
        out if out is not None else src, result if result is not None else src, n,
        HAS_INDEX=index is not None, HAS_LAST=last is not None, HAS_OUT=out is not None, RUN=run, BLOCK=BLOCK,
        num_warps=8)


if triton is not None:
    # Triton kernels: triton.jit is untyped and a kernel's parameters are Triton values whose annotations
    # (tl.constexpr) Triton itself reads, so they stay unannotated for mypy (the ignores below)

    @triton.jit  # type: ignore[untyped-decorator]
    def _gather_max_delta_kernel(  # type: ignore[no-untyped-def]
        src_ptr, idx_ptr, last_ptr, out_ptr, res_ptr, n,
        HAS_INDEX: tl.constexpr, HAS_LAST: tl.constexpr, HAS_OUT: tl.constexpr, RUN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """BLOCK output elements: gather (or read) once, store once, one atomic max of the block's largest."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if HAS_INDEX:
            if RUN == 1:
                at = tl.load(idx_ptr + offs, mask=mask, other=0)
            else:  # a run's start, read once per run (the same address across the run: one cache line)
                at = tl.load(idx_ptr + offs // RUN, mask=mask, other=0).to(tl.int64) + offs % RUN
            v = tl.load(src_ptr + at, mask=mask, other=0.0)
        else:
            v = tl.load(src_ptr + offs, mask=mask, other=0.0)
        if HAS_OUT:
            tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)
        if HAS_LAST:
            d = tl.abs(v.to(tl.float32) - tl.load(last_ptr + offs, mask=mask, other=0.0).to(tl.float32))
            d = tl.where(d != d, float("inf"), d)  # NaN: pushed (see the module docstring)
            tl.atomic_max(res_ptr, tl.max(d, axis=0))
