"""Fold throughput vs a device-to-device copy of the same bytes (GPU; one device).

Qwen3-4B-shaped attention weights (36 layers x q,k,v,o in bf16, 1.76 GiB), rank-32 fp32 adapters.
Prints JSON: the copy anchor (one large copy, and tensor by tensor), torch.addmm fold, and kora's
fused Triton fold, each as TB/s of (read W + write out) bytes, plus fold_vs_copy ratios and the
fraction of elements equal to the fp32 reference.

    python bench/gpu_fold.py [--rank 32] [--reps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial

import torch

from kora_trainer.kernels.fold import fold, fold_reference

SHAPES = [(4096, 2560), (1024, 2560), (1024, 2560), (2560, 4096)]  # q, k, v, o of Qwen3-4B ([out, in])


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() over reps (after two warm-ups), by CUDA events."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="also time kernel configurations")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ws, outs, As, Bs = [], [], [], []
    for _ in range(args.layers):
        for m, n in SHAPES:
            ws.append(torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16))
            outs.append(torch.empty_like(ws[-1]))
            As.append(torch.randn(args.rank, n, device=dev, generator=g) * 0.01)
            Bs.append(torch.randn(m, args.rank, device=dev, generator=g) * 0.01)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty_like(flat_src)
    tbps = lambda ms: 2 * nbytes / (ms / 1e3) / 1e12  # noqa: E731  read + write

    copy_big = timed(lambda: flat_dst.copy_(flat_src), args.reps)
    copy_each = timed(lambda: [o.copy_(w) for o, w in zip(outs, ws, strict=True)], args.reps)
    addmm = timed(
        lambda: [fold_reference(w, a, b, 2.0, out=o) for w, a, b, o in zip(ws, As, Bs, outs, strict=True)], args.reps
    )
    fused = timed(lambda: [fold(w, a, b, 2.0, out=o) for w, a, b, o in zip(ws, As, Bs, outs, strict=True)], args.reps)
    fused_bf16 = timed(
        lambda: [fold(w, a.bfloat16(), b.bfloat16(), 2.0, out=o) for w, a, b, o in zip(ws, As, Bs, outs, strict=True)],
        args.reps,
    )

    # the same 144 launches captured once in a CUDA graph and replayed (Python launch cost removed)
    def graphed(fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compile / warm outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    fused_graph = timed(
        graphed(lambda: [fold(w, a, b, 2.0, out=o) for w, a, b, o in zip(ws, As, Bs, outs, strict=True)]), args.reps
    )
    addmm_graph = timed(
        graphed(lambda: [fold_reference(w, a, b, 2.0, out=o) for w, a, b, o in zip(ws, As, Bs, outs, strict=True)]),
        args.reps,
    )
    big_w = torch.randn(16384, 16384, device=dev, generator=g).to(torch.bfloat16)
    big_a = torch.randn(args.rank, 16384, device=dev, generator=g) * 0.01
    big_b = torch.randn(16384, args.rank, device=dev, generator=g) * 0.01
    big_o = torch.empty_like(big_w)
    big_fold = timed(lambda: fold(big_w, big_a, big_b, 2.0, out=big_o), args.reps)
    big_copy = timed(lambda: big_o.copy_(big_w), args.reps)
    sweep = {}
    if args.sweep:  # kernel configurations on the single large tensor
        configs = [
            (prec, bm, bn, nw)
            for prec in ("tf32x3", "tf32", "ieee")
            for bm, bn in ((64, 256), (128, 128), (128, 256), (256, 128), (32, 512))
            for nw in (4, 8)
        ]
        for prec, bm, bn, nw in configs:
            run = partial(
                fold, big_w, big_a, big_b, 2.0, out=big_o, block_m=bm, block_n=bn, num_warps=nw, precision=prec
            )
            try:
                sweep[f"{prec}_{bm}x{bn}_w{nw}"] = round(big_copy / timed(run, args.reps), 3)
            except Exception as e:  # some shapes run out of shared memory
                sweep[f"{prec}_{bm}x{bn}_w{nw}"] = type(e).__name__
        a16, b16 = big_a.bfloat16(), big_b.bfloat16()
        for bm, bn in ((64, 256), (128, 256), (128, 128)):
            run = partial(fold, big_w, a16, b16, 2.0, out=big_o, block_m=bm, block_n=bn)
            sweep[f"bf16factors_{bm}x{bn}"] = round(big_copy / timed(run, args.reps), 3)
    equal = []
    for w, a, b in zip(ws[:8], As[:8], Bs[:8], strict=True):
        equal.append((fold(w, a, b, 2.0) == fold_reference(w, a, b, 2.0)).float().mean().item())
    print(
        json.dumps(
            {
                "bench": "gpu_fold",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "tensors": len(ws),
                "bytes": nbytes,
                "rank": args.rank,
                "copy_one_large_ms": copy_big,
                "copy_one_large_tbps": tbps(copy_big),
                "copy_per_tensor_ms": copy_each,
                "copy_per_tensor_tbps": tbps(copy_each),
                "addmm_fold_ms": addmm,
                "addmm_fold_tbps": tbps(addmm),
                "fused_fold_ms": fused,
                "fused_fold_tbps": tbps(fused),
                "fused_fold_bf16_factors_ms": fused_bf16,
                "fused_fold_graph_ms": fused_graph,
                "fused_fold_graph_tbps": tbps(fused_graph),
                "addmm_fold_graph_ms": addmm_graph,
                "single_512mib_fold_ms": big_fold,
                "single_512mib_copy_ms": big_copy,
                "single_512mib_fold_vs_copy": big_copy / big_fold,
                "fold_vs_copy": copy_big / fused,
                "fold_graph_vs_copy": copy_big / fused_graph,
                "addmm_vs_copy": copy_big / addmm,
                "fused_equal_to_fp32_reference": min(equal),
                "sweep_single_tensor_fold_vs_copy": sweep,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
