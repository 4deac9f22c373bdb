"""The toy's learning curve in each sync mode for several seeds, through the real train command.

Each run is the command a user types (`python -m kora_trainer.train --config trainer/examples/toy.yaml
--time-limit T algorithm.seed=S lora.syncMode=M`), timed whole from this script, Ray's start included; the
curve comes from the run's event file. What it reports per run: the mean sampled reward of the first and last
10 steps and their difference (`rise`), when the rise first reached the target (the mean of 10 steps against
the first 10), the whole command's seconds, and the median phase times, so a slow run says where its time went.

  python bench/toy_seeds.py --out bench/results/toy_seeds_$(date +%F).json           # 3 modes x 3 seeds, one at a time
  python bench/toy_seeds.py --parallel 8 --cores-per-run 2 ...                       # a many-core box: taskset each run
  python bench/toy_seeds.py --parallel 2 --cores-per-run 2 --first-core 4 --set ...  # recipes side by side

On a box with more cores than one run needs, `--parallel N --cores-per-run C` runs N at once, each pinned to its own C
cores (taskset), to stand in for N machines of C cores; say so when quoting its times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("Merge", "Adapter", "EngineMerge")
WINDOW = 10  # steps averaged at each end of the curve


def run_one(mode: str, seed: int, args: argparse.Namespace, cores: list[int] | None) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"toy-{mode}-{seed}-", dir=args.work))
    cmd = [sys.executable, "-m", "kora_trainer.train", "--config", args.config, "--run-dir", str(run_dir),
           "--time-limit", str(args.time_limit), f"algorithm.seed={seed}", f"lora.syncMode={mode}", *args.set]
    if cores:
        cmd = ["taskset", "-c", ",".join(map(str, cores)), *cmd]
    env = dict(os.environ, KORA_CONTROL_PORT="0", CUDA_VISIBLE_DEVICES="")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()] \
        if (run_dir / "events.jsonl").exists() else []
    result = curve(events, args.target)
    result.update(mode=mode, seed=seed, rc=proc.returncode, command_s=round(wall, 1), cores=cores)
    if proc.returncode != 0:
        result["stderr_tail"] = proc.stderr[-2000:]
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def curve(events: list[dict[str, Any]], target: float) -> dict[str, Any]:
    steps = [e for e in events if e["event"] == "step"]
    if len(steps) < 2 * WINDOW:
        return {"steps": len(steps), "error": "too few steps to compare"}
    rewards = [e["reward_mean"] for e in steps]
    first = statistics.fmean(rewards[:WINDOW])
    last = statistics.fmean(rewards[-WINDOW:])
    reached = next((steps[i]["wall_s"] for i in range(WINDOW, len(steps) + 1)
                    if statistics.fmean(rewards[i - WINDOW:i]) - first >= target), None)

    def median(key: str) -> float:
        return round(statistics.median(e[key] for e in steps), 1)

    per100 = [{"steps": f"{i + 1}-{min(i + 100, len(steps))}",
               "reward_mean": round(statistics.fmean(rewards[i:i + 100]), 3),
               "at_s": round(steps[min(i + 100, len(steps)) - 1]["wall_s"])} for i in range(0, len(steps), 100)]
    start = next((e["wall_s"] for e in events if e["event"] == "start"), None)
    return {"steps": len(steps), "reward_first": round(first, 4), "reward_last": round(last, 4),
            "rise": round(last - first, 4), "target_reached_s": reached, "ready_s": start,
            "train_wall_s": round(steps[-1]["wall_s"], 1), "gen_ms_p50": median("gen_ms"),
            "train_ms_p50": median("train_ms"),
            "sync_ms_p50": round(statistics.median(e["sync"]["ms"] for e in steps), 2),
            "curve_per_100_steps": per100}


def run_pool(jobs: list[Any], slots: list[Any], one: Callable[[Any, Any], dict[str, Any]], hide: str) -> list[Any]:
    """`one(job, slot)` for every job, len(slots) at a time, each run holding a slot (its cores) while it runs; each
    result printed as it lands (less its `hide` key), the results returned in the jobs' order."""
    free = list(slots)

    def go(job: Any) -> dict[str, Any]:
        slot = free.pop()
        try:
            r = one(job, slot)
        finally:
            free.append(slot)
        print(json.dumps({k: v for k, v in r.items() if k != hide}), flush=True)
        return r

    with ThreadPoolExecutor(len(slots)) as pool:
        return list(pool.map(go, jobs))


def add_output_args(p: argparse.ArgumentParser) -> None:
    """Where runs and the report go (shared with bench/vl_seeds.py)."""
    p.add_argument("--work", default=None, help="where the run directories go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--out", default=None)


def toy_path(config: str) -> Path:
    """The toy directory a job config names (model.path, relative to the repository)."""
    import yaml

    return ROOT / yaml.safe_load(Path(ROOT, config).read_text())["model"]["path"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="trainer/examples/toy.yaml")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seeds", default="1234,4242,7")
    p.add_argument("--time-limit", type=float, default=295.0, help="the trainer's --time-limit (default 295: 5 minutes "
                   "of the whole command with Ray's start and stop)")
    p.add_argument("--target", type=float, default=0.5, help="the rise a run should reach (default 0.5)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides for every run")
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--cores-per-run", type=int, default=0, help="with --parallel: pin each run to this many cores")
    p.add_argument("--first-core", type=int, default=0, help="with --cores-per-run: the first core to pin to (so "
                   "several invocations, one recipe each, share a box without sharing cores)")
    add_output_args(p)
    args = p.parse_args()
    args.work = args.work or tempfile.mkdtemp(prefix="toy-seeds-")
    toy = toy_path(args.config)
    if not toy.exists():  # made once, before the timed runs, as `kora make-toy` would
        from kora_trainer.toys.lm import make_toy

        make_toy(toy)
    jobs = [(m, int(s)) for s in args.seeds.split(",") for m in args.modes.split(",")]
    first = args.first_core
    slots = [list(range(first + i * args.cores_per_run, first + (i + 1) * args.cores_per_run))
             if args.cores_per_run else None for i in range(args.parallel)]
    runs = run_pool(jobs, slots, lambda job, cores: run_one(*job, args, cores), hide="curve_per_100_steps")
    ok = [r for r in runs if "rise" in r]
    summary = {"runs": len(runs), "reached_target_within_limit": sum(r["rise"] >= args.target for r in ok),
               "rise_min": min((r["rise"] for r in ok), default=None),
               "command_s_max": max(r["command_s"] for r in runs)}
    print(json.dumps(summary))
    report = {"command": " ".join(sys.argv), "config": args.config, "overrides": args.set,
              "time_limit": args.time_limit, "parallel": args.parallel, "cores_per_run": args.cores_per_run,
              "cpu": os.cpu_count(),
              "date": time.strftime("%F"), "summary": summary, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
