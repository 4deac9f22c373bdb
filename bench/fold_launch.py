"""What of an EngineMerge push is the fold's launch: the engine replays one captured graph of `kernels/fold.GroupedFold`
per push (one fold kernel per adapted weight, spread over `streams` parallel branches), and the host time of that
replay sits between the trainer's gather and the fold on the push's critical path (docs/megatron_backend.md, "Where a
GPU step's time goes"). Per branch count: the host time of one replay (the call alone), the span from the call to
the fold's end with the device idle before it (what a push waits: launch and fold), the fold's own device time (the
device kept busy while it is launched), and the span against the 1-branch graph's. The weights are Qwen3-4B's
q, k, v, o (36 layers, bf16) with rank-32 factors, as bench/gpu_train.py's EngineMerge engine folds them.

    PYTHONPATH=$PWD/trainer python bench/fold_launch.py [--streams 1,2,4,8] [--reps 50] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, RANK = 36, 2560, 32, 8, 128, 32
OUTS = {"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM}


def items(device: torch.device) -> list[Any]:
    from kora_trainer.kernels.fold import FoldItem

    dt = torch.bfloat16
    out: list[Any] = []
    for _ in range(LAYERS):
        shapes = [(m, HIDDEN) for m in OUTS.values()] + [(HIDDEN, HEADS * HEAD_DIM)]  # q, k, v [out, in]; o
        for m, n in shapes:
            w = torch.randn(m, n, device=device, dtype=dt)
            a = torch.randn(RANK, n, device=device, dtype=dt) * 0.01
            b = torch.randn(m, RANK, device=device, dtype=dt) * 0.01
            out.append(FoldItem(w, torch.empty_like(w), a, b, 2.0))
    return out


def measure(streams: int, reps: int, device: torch.device) -> dict[str, float]:
    from kora_trainer.kernels.fold import GroupedFold

    fold = GroupedFold(items(device), streams=streams)
    for _ in range(3):  # capture and first launches
        fold()
    torch.cuda.synchronize(device)
    host, span, dev = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        torch.cuda.synchronize(device)  # the device idle: the launch's host time is in the span
        start.record()
        t0 = time.perf_counter()
        fold()
        host.append((time.perf_counter() - t0) * 1000)
        end.record()
        end.synchronize()
        span.append(start.elapsed_time(end))
        torch.cuda._sleep(2_000_000)  # the device busy ~1 ms while the fold is launched: the fold's own time
        start.record()
        fold()
        end.record()
        end.synchronize()
        dev.append(start.elapsed_time(end))
    return {"host_ms": round(statistics.median(host), 4), "span_ms": round(statistics.median(span), 4),
            "device_ms": round(statistics.median(dev), 4), "kernels": len(fold.singles)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    res: dict[str, Any] = {"bench": "fold_launch", "device": torch.cuda.get_device_name(device), "streams": {}}
    for s in (int(x) for x in a.streams.split(",")):
        res["streams"][s] = measure(s, a.reps, device)
    one = res["streams"].get(1)
    if one:
        for r in res["streams"].values():
            r["span_over_1_branch"] = round(r["span_ms"] / one["span_ms"], 3)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
