"""Why a colocated EngineMerge push costs more than its fold (issue 17): the same fold, replayed by a watcher
thread in a second process that a FIFO wakes, as the reference engine's colocated watcher does — with the waking
process holding no CUDA context, holding one idle, and having just run and synchronised GPU work of its own (the
trainer's case: its delta decision and gather come right before the wake; here into its own memory, not into
the engine's through CUDA IPC as the trainer's gather is). Against the same replay in one process alone. Only
torch and kora's fold kernel, no engine, no trainer, no Ray: what is left is the two processes.

The fold: every q, k, v, o weight of Qwen3-4B's 36 layers (bf16, W0 + s·B·A from a pristine copy, rank 32) as
kernels/fold.GroupedFold, the graph an EngineMerge engine replays per push. Per push, in the watcher: the host time
of the replay call, from before the replay to the synchronise's return, and the CUDA-event time of the fold; in the
waker: the round trip from the wake to the acknowledgement word.

    python bench/colocated_fold_latency.py [--reps 30] [--out RESULT.json]      # GPU only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import select
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

LAYERS, HIDDEN, Q, KV, RANK = 36, 2560, 4096, 1024, 32
SHAPES = [(Q, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, Q)] * LAYERS
FIELDS = ("replay_ms", "total_ms", "device_ms")


def make_fold():  # type: ignore[no-untyped-def]
    from kora_trainer.kernels.fold import FoldItem, GroupedFold

    bf16 = {"dtype": torch.bfloat16, "device": "cuda"}
    items = [FoldItem(torch.randn(m, n, **bf16), torch.empty(m, n, **bf16), torch.randn(RANK, n, **bf16),
                      torch.randn(m, RANK, **bf16), 2.0) for m, n in SHAPES]
    fold = GroupedFold(items)
    fold.prepare()
    return items, fold


def timed(fold) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    fold()
    t1 = time.perf_counter()
    b.record()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1000, (t2 - t0) * 1000, a.elapsed_time(b)


def engine(words, results, fifo: str, reps: int, ready) -> None:  # type: ignore[no-untyped-def]
    """The engine's side: an in-process baseline, then a watcher thread serving every wake."""
    torch.cuda.set_device(0)

    def watch() -> None:
        _items, fold = make_fold()  # captured on this thread, as the engine plans on its watcher's first push
        base = [timed(fold) for _ in range(reps + 3)][3:]
        for i, f in enumerate(FIELDS):
            results[f"alone_{f}"] = statistics.median(x[i] for x in base)
        fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        ready.set()
        seen, laps = 0, []
        while True:
            select.select([fd], [], [], 0.005)
            with contextlib.suppress(BlockingIOError):
                os.read(fd, 4096)
            n = words[0]
            if n == seen or n == 0:  # 0: the waker resetting the words between phases
                seen = n
                continue
            if n == -999:  # the waker is done
                words[1] = n
                return
            if n < 0:  # a phase's end: its medians
                phase = results["phase"]
                for i, f in enumerate(FIELDS):
                    results[f"{phase}_{f}"] = statistics.median(x[i] for x in laps[3:])
                laps = []
                seen = n
                words[1] = n
                continue
            seen = n
            laps.append(timed(fold))
            words[1] = n

    t = threading.Thread(target=watch)
    t.start()
    t.join()


def wake_phase(name: str, words, results, fd: int, reps: int, before=None) -> float:  # type: ignore[no-untyped-def]
    results["phase"] = name
    rts = []
    for i in range(1, reps + 4):
        if before is not None:
            before()
        t0 = time.perf_counter()
        words[0] = i
        os.write(fd, b"\0")
        while words[1] != i:
            time.sleep(0)
        rts.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.005)  # the engine's GPU work is done; the waker's context idles as a trainer's would not
    words[0] = -len(results) - 1  # phase end
    os.write(fd, b"\0")
    end = words[0]
    while words[1] != end:
        time.sleep(0)
    words[0], words[1] = 0, 0
    return statistics.median(rts[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    words = ctx.Array("q", 2, lock=False)
    results = ctx.Manager().dict()
    fifo = os.path.join(tempfile.mkdtemp(), "wake")
    os.mkfifo(fifo)
    ready = ctx.Event()
    proc = ctx.Process(target=engine, args=(words, results, fifo, args.reps, ready))
    proc.start()
    if not ready.wait(300):
        raise SystemExit("the engine process did not get ready")
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    out = {"bench": "colocated_fold_latency", "command": "python bench/colocated_fold_latency.py "
           + " ".join(sys.argv[1:]), "device": None, "round_trip_ms": {}}
    out["round_trip_ms"]["waker_without_cuda"] = wake_phase("no_context", words, results, fd, args.reps)
    torch.cuda.set_device(0)
    out["device"] = torch.cuda.get_device_name(0)
    flat = torch.randn(23_592_960, dtype=torch.bfloat16, device="cuda")  # the adapter's size (rank 32, q k v o)
    index = torch.randperm(flat.numel(), device="cuda", dtype=torch.int64).to(torch.int32)
    slot = torch.empty_like(flat)
    torch.cuda.synchronize()
    out["round_trip_ms"]["waker_context_idle"] = wake_phase("idle_context", words, results, fd, args.reps)

    def gather() -> None:  # the trainer's last GPU work before the wake: a gather, synchronised
        torch.index_select(flat, 0, index, out=slot)
        torch.cuda.synchronize()

    out["round_trip_ms"]["waker_just_synchronised"] = wake_phase("busy_context", words, results, fd, args.reps,
                                                                 gather)
    words[0] = -999
    os.write(fd, b"\0")
    proc.join(60)
    out["engine"] = {k: round(v, 4) for k, v in dict(results).items() if k != "phase"}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
