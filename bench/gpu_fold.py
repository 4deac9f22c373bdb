"""Fold kernel formulations vs a device-to-device copy of the same bytes (GPU; one device).

Qwen3-4B's adapted attention weights as megatron holds them (36 layers x fused QKV [6144, 2560] and proj
[2560, 4096], bf16, 1.76 GiB), rank-32 bf16 factors. Each variant runs tensor by tensor (72 launches) and is
reported as copy_one_large_ms / variant_ms (the fold_vs_copy of bench/gpu_sync.py) next to the copy-only
version of the same loop structure, which is the ceiling of that structure:

- tile:   one [BM, BN] tile per program (kernels.fold's `_fold_kernel`: W loaded first, rank-r dot, add, store)
- loop:   one BM-row block per program, looping over N in BN steps with the next W tile loaded before the
          current one is computed (manual prefetch), B loaded once per row block
- *_copy: the same loop structure without the rank-r product (what the memory system gives that shape)

    PYTHONPATH=trainer python bench/gpu_fold.py [--reps 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from _timing import event_ms  # bench/_timing.py (this script's folder is on sys.path)
from kora_trainer.kernels.fold import _fold_kernel, _rank_pad, fold_reference

SHAPES = [(6144, 2560), (2560, 4096)]  # megatron linear_qkv, linear_proj of Qwen3-4B ([out, in])


@triton.jit
def _loop_kernel(w_ptr, a_ptr, b_ptr, o_ptr, M, N, r, scale, stride_w, stride_o,
                 R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                 PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rm < M
    rr = tl.arange(0, R)
    if DOT:
        b = tl.load(b_ptr + rm[:, None] * r + rr[None, :], mask=mask_m[:, None] & (rr[None, :] < r), other=0.0)
    cols = tl.arange(0, BLOCK_N)
    w_rows = w_ptr + rm[:, None] * stride_w
    o_rows = o_ptr + rm[:, None] * stride_o
    w = tl.load(w_rows + cols[None, :], mask=mask_m[:, None] & (cols[None, :] < N), other=0.0)
    for n0 in range(0, N, BLOCK_N):
        rn = n0 + cols
        mask = mask_m[:, None] & (rn[None, :] < N)
        if PREFETCH:
            nxt = rn + BLOCK_N
            w_next = tl.load(w_rows + nxt[None, :], mask=mask_m[:, None] & (nxt[None, :] < N), other=0.0)
        else:
            w = tl.load(w_rows + rn[None, :], mask=mask, other=0.0)
        acc = w.to(tl.float32)
        if DOT:
            a = tl.load(a_ptr + rr[:, None] * N + rn[None, :], mask=(rr[:, None] < r) & (rn[None, :] < N), other=0.0)
            acc = acc + scale * tl.dot(b, a)
        tl.store(o_rows + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=mask)
        if PREFETCH:
            w = w_next


@triton.jit
def _tile_copy_kernel(w_ptr, o_ptr, M, N, stride_w, stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    w = tl.load(w_ptr + rm[:, None] * stride_w + rn[None, :], mask=mask, other=0.0)
    tl.store(o_ptr + rm[:, None] * stride_o + rn[None, :], w, mask=mask)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ws, outs, As, Bs = [], [], [], []
    for _ in range(args.layers):
        for m, n in SHAPES:
            ws.append(torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16))
            outs.append(torch.empty_like(ws[-1]))
            As.append((torch.randn(args.rank, n, device=dev, generator=g) * 0.01).bfloat16())
            Bs.append((torch.randn(m, args.rank, device=dev, generator=g) * 0.01).bfloat16())
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    res: dict = {"bench": "gpu_fold", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "tensors": len(ws), "bytes": nbytes, "rank": args.rank}
    copy = event_ms(lambda: dst.copy_(src), args.reps)
    res["copy_one_large_ms"] = copy
    res["copy_tbps"] = 2 * nbytes / (copy / 1e3) / 1e12
    res["copy_per_tensor_ms"] = event_ms(lambda: [o.copy_(w) for o, w in zip(outs, ws, strict=True)], args.reps)
    items = list(zip(ws, As, Bs, outs, strict=True))
    r_pad = _rank_pad(args.rank)
    variants: dict[str, float | str] = {}

    def run(name, fn):
        try:
            ms = event_ms(fn, args.reps)
            variants[name] = round(copy / ms, 3)
        except Exception as e:
            variants[name] = f"{type(e).__name__}: {str(e)[:160]}"

    for bm, bn, nw in ((64, 128, 4), (64, 256, 4), (128, 128, 8), (128, 256, 8)):
        run(f"tile_{bm}x{bn}_w{nw}", lambda bm=bm, bn=bn, nw=nw: [
            _fold_kernel[(triton.cdiv(w.shape[0], bm), triton.cdiv(w.shape[1], bn))](
                w, a, b, o, w, w.shape[0], w.shape[1], args.rank, 2.0, w.stride(0), o.stride(0), R=r_pad,
                BLOCK_M=bm, BLOCK_N=bn, PRECISION="tf32", HAS_LORA=True, MAP_MODE=0, NATIVE_DOT=True,
                FMA=False, BIG=False, num_warps=nw) for w, a, b, o in items])
        run(f"tile_copy_{bm}x{bn}_w{nw}", lambda bm=bm, bn=bn, nw=nw: [
            _tile_copy_kernel[(triton.cdiv(w.shape[0], bm), triton.cdiv(w.shape[1], bn))](
                w, o, w.shape[0], w.shape[1], w.stride(0), o.stride(0), BLOCK_M=bm, BLOCK_N=bn, num_warps=nw)
            for w, a, b, o in items])
    for bm, bn, nw in ((16, 256, 4), (32, 256, 4)):
        for dot in (True, False):
            for pre in (True, False):
                if bm < 16 and dot:
                    continue
                name = f"loop{'' if dot else '_copy'}{'_pre' if pre else ''}_{bm}x{bn}_w{nw}"
                run(name, lambda bm=bm, bn=bn, nw=nw, dot=dot, pre=pre: [
                    _loop_kernel[(triton.cdiv(w.shape[0], bm),)](
                        w, a, b, o, w.shape[0], w.shape[1], args.rank, 2.0, w.stride(0), o.stride(0), R=r_pad,
                        BLOCK_M=bm, BLOCK_N=bn, DOT=dot, PREFETCH=pre, num_warps=nw) for w, a, b, o in items])
    # one launch for all 72 tensors (kernels.fold.GroupedFold), fold and copy-only
    from kora_trainer.kernels.fold import FoldItem, GroupedFold

    for bm, bn, nw in ((64, 128, 4), (128, 128, 8), (32, 256, 4), (64, 256, 4), (32, 128, 4), (16, 256, 4),
                       (128, 64, 4), (64, 64, 4)):
        run(f"grouped_{bm}x{bn}_w{nw}", GroupedFold([FoldItem(w, o, a, b, 2.0) for w, a, b, o in items],
                                                    block_m=bm, block_n=bn, num_warps=nw))
        run(f"grouped_copy_{bm}x{bn}_w{nw}", GroupedFold([FoldItem(w, o) for w, a, b, o in items],
                                                         block_m=bm, block_n=bn, num_warps=nw))

    # the per-tensor launches captured in a CUDA graph: the kernels' own time, without Python launch cost
    def graphed(fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    run("tile_64x128_w4_graph", graphed(lambda: [
        _fold_kernel[(triton.cdiv(w.shape[0], 64), triton.cdiv(w.shape[1], 128))](
            w, a, b, o, w, w.shape[0], w.shape[1], args.rank, 2.0, w.stride(0), o.stride(0), R=r_pad,
            BLOCK_M=64, BLOCK_N=128, PRECISION="tf32", HAS_LORA=True, MAP_MODE=0, NATIVE_DOT=True,
            FMA=False, BIG=False, num_warps=4) for w, a, b, o in items]))
    run("copy_per_tensor_graph", graphed(lambda: [o.copy_(w) for o, w in zip(outs, ws, strict=True)]))
    res["vs_copy"] = variants
    best = max((k for k, v in variants.items() if isinstance(v, float) and "copy" not in k), key=variants.get,
               default=None)
    res["best"] = best
    # correctness of the loop kernel against torch's fp32 addmm fold
    w, a, b, o = items[0]
    _loop_kernel[(triton.cdiv(w.shape[0], 32),)](w, a, b, o, w.shape[0], w.shape[1], args.rank, 2.0, w.stride(0),
                                                 o.stride(0), R=r_pad, BLOCK_M=32, BLOCK_N=256, DOT=True,
                                                 PREFETCH=True, num_warps=4)
    ref = fold_reference(w, a, b, 2.0)
    res["loop_equal_to_fp32_addmm"] = float((o == ref).float().mean())
    text = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
