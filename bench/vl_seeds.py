"""The VL toy's learning curve (docs/vl.md) in Merge scope all and Adapter scope language for several seeds, through
the real train command.

Each run is the command a user types (`python -m kora_trainer.train --config trainer/examples/vl_toy.yaml
algorithm.seed=S lora.syncMode=M lora.scope=SCOPE ...`), timed whole from this script, Ray's start included; the
curve comes from the run's event file, read as bench/toy_seeds.py reads it (`curve`): the mean sampled reward of the
first and last 10 steps, their difference (`rise`), when a 10-step mean first stood `--target` above the first 10
(seconds since the trainer started), the whole command's seconds.

Each run gets one torch thread (OMP_NUM_THREADS=1) and, with `--cores`, its own core (taskset), so two runs side by
side on a 2-core box stand in for two 1-core machines:

  python bench/vl_seeds.py --seeds 1,2 --parallel 2 --cores 0,1 --out bench/results/vl_seeds_$(date +%F).json
  python bench/vl_seeds.py --seeds 1 --set algorithm.lr=0.005 algorithm.numSteps=120 ...   # a recipe to try
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench/ is the script's directory, its first sys.path entry
from toy_seeds import add_output_args, curve, run_pool, toy_path

ROOT = Path(__file__).resolve().parent.parent
# the two modes issue 20 asks for: Adapter + scope all is refused on a VL model (SPEC rule 4)
MODES = {"Merge": "all", "Adapter": "language"}


def run_one(mode: str, seed: int, args: argparse.Namespace, core: str | None) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"vl-{mode}-{seed}-", dir=args.work))
    cmd = [sys.executable, "-m", "kora_trainer.train", "--config", args.config, "--run-dir", str(run_dir),
           "--time-limit", str(args.time_limit), f"algorithm.seed={seed}", f"lora.syncMode={mode}",
           f"lora.scope={MODES[mode]}", *args.set]
    if core is not None:
        cmd = ["taskset", "-c", core, *cmd]
    env = dict(os.environ, KORA_CONTROL_PORT="0", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    events_file = run_dir / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
    result = curve(events, args.target)
    result.pop("curve_per_100_steps", None)
    steps = [e for e in events if e["event"] == "step"]
    result.update(mode=mode, scope=MODES[mode], seed=seed, rc=proc.returncode, command_s=round(wall, 1), core=core,
                  rewards=[round(e["reward_mean"], 3) for e in steps],
                  gap_max=max((e["rollout_logp_gap_max"] for e in steps
                               if e.get("rollout_logp_gap_max") is not None), default=None))
    if proc.returncode != 0:
        result["stderr_tail"] = proc.stderr[-2000:]
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="trainer/examples/vl_toy.yaml")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--time-limit", type=float, default=600.0, help="the trainer's --time-limit")
    p.add_argument("--target", type=float, default=0.2, help="the rise a run should reach (default 0.2)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides for every run")
    p.add_argument("--parallel", type=int, default=1, help="runs at once without --cores "
                   "(at most 2 on a shared 2-core box)")
    p.add_argument("--cores", default="", help="comma-separated cores, one run on each at a "
                   "time (taskset); sets how many run at once")
    add_output_args(p)
    args = p.parse_args()
    args.work = args.work or tempfile.mkdtemp(prefix="vl-seeds-")
    toy = toy_path(args.config)
    if not toy.exists():  # made once, before the timed runs, as `kora make-toy --vl` would
        from kora_trainer.toys.vl import make_vl_toy

        make_vl_toy(toy)
    jobs = [(m, int(s)) for s in args.seeds.split(",") for m in args.modes.split(",")]
    cores: list[str | None] = list(args.cores.split(",")) if args.cores else [None] * args.parallel
    runs = run_pool(jobs, cores, lambda job, core: run_one(*job, args, core), hide="rewards")
    ok = [r for r in runs if "rise" in r]
    summary = {"runs": len(runs), "reached_target": sum(r["target_reached_s"] is not None for r in ok),
               "rise_min": min((r["rise"] for r in ok), default=None),
               "command_s_max": max(r["command_s"] for r in runs)}
    print(json.dumps(summary))
    report = {"command": " ".join(sys.argv), "config": args.config, "overrides": args.set, "target": args.target,
              "parallel": args.parallel, "cores": args.cores, "threads_per_run": 1, "cpu": os.cpu_count(),
              "toy": json.loads((toy / "toy.json").read_text()), "date": time.strftime("%F"), "summary": summary,
              "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
