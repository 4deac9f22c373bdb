"""Fused LoRA fold: out = round(W + s·B·A), accumulated in fp32 and rounded once.

Merge-mode sync folds every adapted weight every step, so the fold must run at memory speed:
it reads W once and writes the result once (the rank-r product is recomputed per tile, which
costs far less than a trip through memory). torch.addmm materialises W in fp32 first, and
reached ~0.24x of device-copy bandwidth on an H200 (../shared/GPU.md); this kernel streams tiles.
Measured (H200, 2026-11-30, bench/results/gpu_fold_2026-11-30.json): 0.59x of copy with bf16
factors, 0.39x with fp32 factors (3-pass tf32 for fp32 accuracy) — short of the 0.7x target.

`out` may be W itself (in place), a slice of a flat sync bucket, or a fresh tensor.
On CPU (or without Triton) the same function runs a torch reference with the same rounding.
"""

from __future__ import annotations

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

    @triton.jit
    def _fold_kernel(
        w_ptr,
        a_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        scale,
        stride_wm,
        stride_am,
        stride_bm,
        stride_om,
        R: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of W (out features)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # cols of W (in features)
        rr = tl.arange(0, R)
        mask_m, mask_n = rm < M, rn < N
        b = tl.load(b_ptr + rm[:, None] * stride_bm + rr[None, :], mask=mask_m[:, None], other=0.0)  # [BM, R]
        a = tl.load(a_ptr + rr[:, None] * stride_am + rn[None, :], mask=mask_n[None, :], other=0.0)  # [R, BN]
        delta = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision=PRECISION)  # [BM, BN] fp32
        mask = mask_m[:, None] & mask_n[None, :]
        w = tl.load(w_ptr + rm[:, None] * stride_wm + rn[None, :], mask=mask, other=0.0)
        result = w.to(tl.float32) + scale * delta
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], result.to(out_ptr.dtype.element_ty), mask=mask)


def fold(
    w: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    block_m: int = 128,
    block_n: int | None = None,
    num_warps: int = 8,
    num_stages: int = 2,
    precision: str | None = None,
) -> torch.Tensor:
    """Fused fold on CUDA (Triton), torch reference elsewhere. Shapes: w [M, N], a [r, N], b [M, r]."""
    if triton is None or not w.is_cuda:
        return fold_reference(w, a, b, scale, out)
    m, n = w.shape
    r = a.shape[0]
    if b.shape != (m, r) or a.shape[1] != n:
        raise ValueError(f"fold: W {tuple(w.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)} do not line up")
    if out is None:
        out = torch.empty_like(w)
    # tl.dot needs R >= 16 and a power of two: pad the rank with zeros (exact: they add nothing)
    r_pad = max(16, triton.next_power_of_2(r))
    if r_pad != r:
        a = torch.nn.functional.pad(a, (0, 0, 0, r_pad - r))
        b = torch.nn.functional.pad(b, (0, r_pad - r))
    a, b = a.contiguous(), b.contiguous()
    w_c = w if w.stride(1) == 1 else w.contiguous()
    # bf16/fp16 factors are exact in tf32; fp32 factors need the 3-pass split to keep fp32 accuracy
    if precision is None:
        precision = "tf32" if a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype else "tf32x3"
    if block_n is None:  # keep the A tile [R, BLOCK_N] within shared memory for large ranks
        block_n = 128 if r_pad <= 64 else 64  # 128x128 was fastest in bench/gpu_fold.py --sweep (H200)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fold_kernel[grid](
        w_c,
        a,
        b,
        out,
        m,
        n,
        float(scale),
        w_c.stride(0),
        a.stride(0),
        b.stride(0),
        out.stride(0),
        R=r_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
