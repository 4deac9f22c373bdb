"""Why a colocated EngineMerge push costs more than its fold (issue 17): the engine's work, replayed by a watcher
thread in a second process that a FIFO wakes, as the reference engine's colocated watcher does, under the
conditions a push meets in a training run — pushes back to back, pushes a second apart, and pushes after a step
(the engine generating from another of its threads, then the waker's own GPU work) — with and without a warm-up
of the watcher ahead of the push. Only torch and kora's fold kernel: no engine, no trainer, no Ray.

Why: in a hot loop (2026-12-04) a second process's watcher replays the fold in 0.02-0.04 ms of host time and
answers 1.28-1.38 ms after the wake for 1.13-1.18 ms of device work, within the issue's 1.2x; the real engine,
pushed once per GRPO step, spends 0.3-0.4 ms of its thread's CPU before the fold starts (docs/megatron_backend.md,
"Session 20"). This tells whether that is the push's conditions (caches and clocks gone cold over a step, another
thread's CUDA launches) rather than the engine's code, and whether warming the watcher when the step's training
starts takes it back.

The engine's work per push, as colocated_gather.py does it: one captured graph gathering the trainer's adapter
(23.6 M bf16 elements: Qwen3-4B's rank-32 q, k, v, o adapter) into a ring slot, then the fold's captured graph
(kernels/fold.GroupedFold of every q, k, v, o weight of the 36 layers, W0 + s·B·A, bf16), then a synchronise.

Conditions (`--conditions`, each `--reps` pushes, medians past the first 3):
    hot          a push every 5 ms
    idle         a push every second, nothing between (idle_spin, idle_replay: with the WARM word below, stored
                 when the second starts)
    stepped      before each push the engine's other thread "generates" for --generate-ms (small matmuls,
                 synchronised every few), then the waker "trains" for --train-ms (large matmuls, synchronised)
    stepped_spin    ... and when the waker starts training, a WARM word: the watcher spins on the words
                    until the push instead of sleeping in select
    stepped_replay  ... the WARM word makes the watcher replay its gather graph once (the slot is rewritten
                    by the push) and synchronise, then sleep as usual
    stepped_fold    ... the gather and the fold replayed once (a diagnosis, not a remedy: in an engine that is
                    1.2 ms of device time taken from the trainer's step)
    hot_xthread, stepped_xthread  hot and stepped, the graphs captured on another thread than the watcher that
                    replays them (the reference engine plans on an HTTP handler's thread, replays on its watcher)
    hot_ipc, stepped_ipc  ... and the gather's source the waker's flat adapter, mapped (CUDA IPC), as the engine
                    maps the trainer's

Per push, the engine reports on one clock with the waker (CLOCK_MONOTONIC): wake (the request stored to the
watcher reading it), the host time of each replay call, the watcher thread's CPU time from the wake to both
graphs enqueued, the span to the synchronise's return and the CUDA-event time of the two graphs; the waker the
round trip from the request to the acknowledgement. `alone` is the replays and synchronise in the engine's
process in a hot loop (the anchor).

    python bench/colocated_fold_latency.py [--reps 20] [--conditions hot,idle,stepped,...] [--out RESULT.json]
    python bench/colocated_fold_latency.py --cpu-smoke      # tiny, CPU, no graphs: the plumbing only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

LAYERS, HIDDEN, Q, KV, RANK = 36, 2560, 4096, 1024, 32
ADAPTER = 23_592_960  # rank-32 q, k, v, o of the 36 layers: the trainer's flat adapter, in elements
# the words (int64): REQ (the waker: push n > 0, -n a condition's end, STOP), ACK (the engine), GEN / GEN_ACK (the
# engine's generating thread), GEN_MS, WARM (the waker, when its step starts), WARM_KIND, T_REQ (µs), WORK (which of
# the engine's Work objects a push uses: 0 its own, 1 captured on another thread, 2 that and the waker's flat mapped)
REQ, ACK, GEN, GEN_ACK, GEN_MS, WARM, WARM_KIND, T_REQ, WORK = range(9)
WARM_KINDS = {"": 0, "spin": 1, "replay": 2, "fold": 3}
STOP = -(1 << 40)
FIELDS = ("wake_ms", "gather_replay_ms", "fold_replay_ms", "launch_cpu_ms", "total_ms", "device_ms")


@dataclass(frozen=True)
class Condition:
    gap_s: float = 0.005
    stepped: bool = False
    warm: str = ""
    work: int = 0  # the WORK word


CONDITIONS = {"hot": Condition(), "idle": Condition(gap_s=1.0), "idle_spin": Condition(gap_s=1.0, warm="spin"),
              "idle_replay": Condition(gap_s=1.0, warm="replay"), "stepped": Condition(gap_s=0.0, stepped=True),
              "stepped_spin": Condition(gap_s=0.0, stepped=True, warm="spin"),
              "stepped_replay": Condition(gap_s=0.0, stepped=True, warm="replay"),
              "stepped_fold": Condition(gap_s=0.0, stepped=True, warm="fold"),
              "hot_xthread": Condition(work=1), "stepped_xthread": Condition(gap_s=0.0, stepped=True, work=1),
              "hot_ipc": Condition(work=2), "stepped_ipc": Condition(gap_s=0.0, stepped=True, work=2)}


def now_us() -> int:
    return time.monotonic_ns() // 1000


class Work:
    """The engine's per-push work: the gather graph and the fold graph (plain calls on CPU)."""

    def __init__(self, device: torch.device, smoke: bool, flat: torch.Tensor | None = None):
        from kora_trainer.kernels.fold import FoldItem, GroupedFold

        self.device, self.cuda = device, device.type == "cuda"
        layers, hidden, q, kv, rank, adapter = (2, 64, 64, 32, 4, 4096) if smoke else (LAYERS, HIDDEN, Q, KV, RANK,
                                                                                      ADAPTER)
        def randn(*size: int) -> torch.Tensor:
            return torch.randn(*size, dtype=torch.bfloat16, device=device)

        self.flat = randn(adapter) if flat is None else flat
        self.slot = torch.empty_like(self.flat)
        shapes = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q)] * layers
        self.items = [FoldItem(randn(m, n), randn(m, n), randn(rank, n) * 0.01, randn(m, rank) * 0.01, 2.0)
                      for m, n in shapes]
        self.fold = GroupedFold(self.items)
        self.gather_graph: Any = None
        if self.cuda:
            self.fold.prepare()
            self.slot.copy_(self.flat)
            torch.cuda.synchronize(device)
            self.gather_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.gather_graph):
                self.slot.copy_(self.flat)
            self.gather_graph.replay()
            torch.cuda.synchronize(device)

    def gather(self) -> None:
        if self.gather_graph is not None:
            self.gather_graph.replay()
        else:
            self.slot.copy_(self.flat)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self) -> dict[str, float]:
        """One push's work, timed (wake_ms is the caller's)."""
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else []
        c0, t0 = time.thread_time(), time.perf_counter()
        if marks:
            marks[0].record()
        self.gather()
        t1 = time.perf_counter()
        self.fold()
        if marks:
            marks[1].record()
        t2, c1 = time.perf_counter(), time.thread_time()
        self.sync()
        t3 = time.perf_counter()
        return {"gather_replay_ms": (t1 - t0) * 1e3, "fold_replay_ms": (t2 - t1) * 1e3,
                "launch_cpu_ms": (c1 - c0) * 1e3, "total_ms": (t3 - t0) * 1e3,
                "device_ms": marks[0].elapsed_time(marks[1]) if marks else 0.0}


def busy(device: torch.device, ms: float, size: int, sync_every: int) -> None:
    """GPU work driven from this thread for about `ms`: matmuls of [size, size], synchronised every `sync_every`."""
    x = torch.randn(size, size, device=device)
    w = torch.randn(size, size, device=device) / size**0.5
    end = time.perf_counter() + ms / 1e3
    i = 0
    while time.perf_counter() < end:
        x = torch.tanh(x @ w)
        i += 1
        if i % sync_every == 0 and device.type == "cuda":
            torch.cuda.synchronize(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """The engine's process: a generating thread and the watcher thread (which makes the work, as the engine plans
    on its watcher)."""

    def __init__(self, words: Any, results: Any, fifo: str, reps: int, device: torch.device, smoke: bool,
                 mapped: torch.Tensor):
        self.words, self.results, self.fifo, self.reps, self.mapped = words, results, fifo, reps, mapped
        self.device, self.smoke = device, smoke
        self.stopping = threading.Event()
        self.laps: list[dict[str, float]] = []

    def _on_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def generate(self) -> None:
        self._on_device()
        seen, w = 0, self.words
        while not self.stopping.is_set():
            n = w[GEN]
            if n == seen:
                time.sleep(0.001)
                continue
            seen = n
            busy(self.device, w[GEN_MS], 64 if self.smoke else 1024, 4)  # a decode step's small launches
            w[GEN_ACK] = n

    def _warm(self, work: Work, seen: int) -> None:
        kind, w = self.words[WARM_KIND], self.words
        if kind == WARM_KINDS["spin"]:
            while w[REQ] == seen:
                time.sleep(0)
        elif kind in (WARM_KINDS["replay"], WARM_KINDS["fold"]):
            work.gather()
            if kind == WARM_KINDS["fold"]:
                work.fold()
            work.sync()

    def _serve(self, work: Work, n: int, t_seen: int) -> None:
        """Request n: a push (n > 0) or a condition's end (its medians)."""
        if n < 0:
            phase = self.results["phase"]
            for f in FIELDS:
                self.results[f"{phase}_{f}"] = statistics.median(x[f] for x in self.laps[3:])
            self.laps = []
        else:
            lap = work.timed()
            lap["wake_ms"] = (t_seen - self.words[T_REQ]) / 1e3
            self.laps.append(lap)
        self.words[ACK] = n

    def watch(self, ready: Any) -> None:
        self._on_device()
        work, w = Work(self.device, self.smoke), self.words
        made: list[Work] = []

        def make() -> None:
            self._on_device()
            made.extend([Work(self.device, self.smoke), Work(self.device, self.smoke, self.mapped)])

        maker = threading.Thread(target=make)
        maker.start()
        maker.join()
        works = {0: work, 1: made[0], 2: made[1]}
        alone = [work.timed() for _ in range(self.reps + 3)][3:]
        for f in FIELDS[1:]:
            self.results[f"alone_{f}"] = statistics.median(x[f] for x in alone)
        fd = os.open(self.fifo, os.O_RDWR | os.O_NONBLOCK)
        ready.set()
        seen, warmed = 0, 0
        while True:
            if w[WARM] != warmed:
                warmed = w[WARM]
                self._warm(works[w[WORK]], seen)
            if w[REQ] == seen:
                select.select([fd], [], [], 0.005)
                with contextlib.suppress(BlockingIOError):
                    os.read(fd, 4096)
            n = w[REQ]
            if n == seen:
                continue
            t_seen, seen = now_us(), n
            if n == STOP:
                self.stopping.set()
                w[ACK] = n
                return
            self._serve(works[w[WORK]], n, t_seen)


def engine(words: Any, results: Any, fifo: str, reps: int, ready: Any, device_name: str, smoke: bool,
           mapped: torch.Tensor) -> None:
    side = Engine(words, results, fifo, reps, torch.device(device_name), smoke, mapped)
    side._on_device()
    threads = [threading.Thread(target=side.generate), threading.Thread(target=side.watch, args=(ready,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Waker:
    """The trainer's side: its step's GPU work, its last gather (synchronised) and the request."""

    def __init__(self, words: Any, fd: int, device: torch.device, smoke: bool, train_ms: float, generate_ms: float,
                 flat: torch.Tensor):
        self.words, self.fd, self.device, self.smoke = words, fd, device, smoke
        self.train_ms, self.generate_ms = train_ms, generate_ms
        self.n = 0
        n = flat.numel()
        self.flat = flat  # the engine maps it (hot_ipc, stepped_ipc)
        self.index = torch.randperm(n, device=device)
        self.slot = torch.empty_like(self.flat)

    def ask(self, value: int) -> float:
        """Store REQ (and T_REQ), poke, wait for ACK: the round trip in ms."""
        w = self.words
        t0 = time.perf_counter()
        w[T_REQ] = now_us()
        w[REQ] = value
        with contextlib.suppress(BlockingIOError):
            os.write(self.fd, b"\0")
        deadline = t0 + 60
        while w[ACK] != value:
            if time.perf_counter() > deadline:
                raise SystemExit(f"the engine did not answer request {value} within 60 s")
            time.sleep(0)
        return (time.perf_counter() - t0) * 1e3

    def step(self, cond: Condition) -> None:
        """What comes before a push: the engine generating, then this process training or idling (WARM as that
    starts)."""
        w = self.words
        w[WORK] = cond.work
        if cond.stepped:
            w[GEN_MS] = int(self.generate_ms)
            w[GEN] += 1
            while w[GEN_ACK] != w[GEN]:
                time.sleep(0.0005)
        if cond.warm:
            w[WARM_KIND] = WARM_KINDS[cond.warm]
            w[WARM] += 1
        if cond.stepped:
            busy(self.device, self.train_ms, 256 if self.smoke else 4096, 16)
        torch.index_select(self.flat, 0, self.index, out=self.slot)  # the trainer's last work: synchronised
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        time.sleep(cond.gap_s)

    def condition(self, name: str, cond: Condition, reps: int, results: Any) -> float:
        results["phase"] = name
        rts = []
        for _ in range(reps + 3):
            self.step(cond)
            self.n += 1
            rts.append(self.ask(self.n))
        self.n += 1
        self.ask(-self.n)
        return statistics.median(rts[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--train-ms", type=float, default=250.0, help="the waker's step (a GRPO train phase's order)")
    ap.add_argument("--generate-ms", type=float, default=1000.0, help="the engine's rollouts before it")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, no graphs: the plumbing only")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    names = [c for c in args.conditions.split(",") if c]
    unknown = [c for c in names if c not in CONDITIONS]
    if unknown:
        raise SystemExit(f"--conditions: unknown {unknown}; known: {', '.join(CONDITIONS)}")
    device_name = "cpu" if args.cpu_smoke else "cuda:0"
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    flat = torch.randn(4096 if args.cpu_smoke else ADAPTER, dtype=torch.bfloat16, device=device)
    ctx = torch.multiprocessing.get_context("spawn")  # its pickler sends `flat` as a CUDA IPC handle
    words = ctx.Array("q", 9, lock=False)
    results = ctx.Manager().dict()
    fifo = os.path.join(tempfile.mkdtemp(), "wake")
    os.mkfifo(fifo)
    ready = ctx.Event()
    proc = ctx.Process(target=engine, args=(words, results, fifo, args.reps, ready, device_name, args.cpu_smoke,
                                                 flat))
    proc.start()
    if not ready.wait(300):
        proc.kill()
        raise SystemExit("the engine process did not get ready within 300 s")
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    waker = Waker(words, fd, device, args.cpu_smoke, args.train_ms, args.generate_ms, flat)
    out: dict[str, Any] = {"bench": "colocated_fold_latency", "command": "python bench/colocated_fold_latency.py "
                           + " ".join(sys.argv[1:]), "device": torch.cuda.get_device_name(0) if device.type == "cuda"
                           else "cpu", "train_ms": args.train_ms, "generate_ms": args.generate_ms,
                           "round_trip_ms": {}}
    try:
        for name in names:
            out["round_trip_ms"][name] = round(waker.condition(name, CONDITIONS[name], args.reps, results), 4)
            print(name, out["round_trip_ms"][name], "ms round trip", flush=True)
        waker.ask(STOP)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    res = dict(results)
    out["engine"] = {k: round(v, 4) for k, v in res.items() if k != "phase"}
    out["by_condition"] = {n: {f: out["engine"].get(f"{n}_{f}") for f in FIELDS} for n in ["alone", *names]}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
