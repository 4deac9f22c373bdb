"""Multi-LoRA through the product (`python -m kora_trainer.train` on trainer/examples/multi_lora.yaml, its event
file), on the toy with the reference engine.

    python bench/multi_lora.py [--steps 12] [--out FILE]            # 1, 2 and 4 adapters
    python bench/multi_lora.py --curves [--time-limit 480] [--out FILE]

Scaling (default): the same job with 1, 2 and 4 adapters (each rank 16, the same batch, different seeds), one run
after the other; the anchor is the 1-adapter run of the same invocation. Per run: the bytes and ms of each push
(selective sync: one adapter's tensors, whatever the count), pushes per adapter step (1: only what stepped), each
adapter's generation throughput (samples per second of its batch's generation) and the job's (samples trained
per second of wall time, all adapters together); ratios to 1 adapter. The first two rounds are warm-up.

--curves: the example's two adapters (`add`: all 10,000 sums; `small`: the 400 sums of numbers below 20; both the
math reward) trained at once for --time-limit seconds of the whole command; both reward curves and each one's mean over
its first and last 10 steps. Results: bench/results/multi_lora_*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "trainer" / "examples" / "multi_lora.yaml"
WARMUP = 2


def trainer(job: dict, work: Path, *extra: str, timeout_s: float = 1800) -> list[dict]:
    """Run the trainer on `job`; its events."""
    from kora_trainer.recorder import read_events

    work.mkdir(parents=True, exist_ok=True)
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    cmd = [sys.executable, "-m", "kora_trainer.train", "--config", str(work / "job.yaml"), "--run-dir",
           str(work / "run"), "--control-port", "0", "--make-toy", *extra]
    path = [str(REPO / "trainer"), str(REPO / "engine"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"the trainer exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return read_events(work / "run")


def example(model: str, work: Path) -> dict:
    job = yaml.safe_load(EXAMPLE.read_text())
    job["model"]["path"] = model
    job["data"]["path"] = f"{model}/train.parquet"
    job["checkpoint"]["path"] = str(work / "ckpt")
    for a in job["multiLora"]["adapters"]:  # each its own file of the toy
        a["data"]["path"] = f"{model}/{Path(a['data']['path']).name}"
    return job


def scaling_run(model: str, n: int, steps: int, work: Path) -> dict:
    job = example(model, work / f"n{n}")
    adapter = {**job["multiLora"]["adapters"][0], "numSteps": steps}
    job["multiLora"]["adapters"] = [{**adapter, "name": f"a{i}", "seed": 100 + i} for i in range(n)]
    t0 = time.monotonic()
    events = trainer(job, work / f"n{n}")
    steps_ev = [e for e in events if e["event"] == "adapter_step" and e["step"] > WARMUP]
    pushes = [e["sync"] for e in steps_ev if e["sync"]["pushed"]]
    walls = [e["wall_s"] for e in steps_ev]
    samples = sum(e["samples"] for e in steps_ev)
    return {"adapters": n, "push_bytes": statistics.median(p["bytes"] for p in pushes),
            "push_ms_p50": round(statistics.median(p["ms"] for p in pushes), 2),
            "pushes_per_adapter_step": round(len(pushes) / len(steps_ev), 3),
            "gen_samples_per_s_per_adapter": round(statistics.median(e["samples"] / (e["gen_ms"] / 1000)
                                                                     for e in steps_ev), 1),
            "job_samples_per_s": round(samples / max(walls[-1] - walls[0], 1e-9), 1),
            "adapter_steps": len(steps_ev), "run_s": round(time.monotonic() - t0, 1)}


def scaling(model: str, steps: int, work: Path) -> dict:
    runs = [scaling_run(model, n, steps, work) for n in (1, 2, 4)]
    one = runs[0]
    for r in runs:
        r["ratio_push_bytes"] = round(r["push_bytes"] / one["push_bytes"], 3)
        r["ratio_push_ms"] = round(r["push_ms_p50"] / one["push_ms_p50"], 3)
        r["ratio_gen_throughput_per_adapter"] = round(r["gen_samples_per_s_per_adapter"]
                                                      / one["gen_samples_per_s_per_adapter"], 3)
        r["ratio_job_throughput"] = round(r["job_samples_per_s"] / one["job_samples_per_s"], 3)
    return {"bench": "multi_lora_scaling", "steps_per_adapter": steps, "runs": runs}


def curves(model: str, time_limit: float, work: Path) -> dict:
    events = trainer(example(model, work), work, "--time-limit", str(time_limit), timeout_s=time_limit + 300)
    out: dict = {"bench": "multi_lora_curves", "time_limit_s": time_limit, "adapters": {}}
    for name in dict.fromkeys(e["adapter"] for e in events if e["event"] == "adapter_step"):
        steps = [e for e in events if e["event"] == "adapter_step" and e["adapter"] == name]
        curve = [e["reward_mean"] for e in steps]
        out["adapters"][name] = {
            "steps": len(curve), "reward_first10": round(statistics.fmean(curve[:10]), 4),
            "reward_last10": round(statistics.fmean(curve[-10:]), 4),
            "rise": round(statistics.fmean(curve[-10:]) - statistics.fmean(curve[:10]), 4),
            "last_step_wall_s": steps[-1]["wall_s"], "reward_curve": [round(x, 3) for x in curve]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / ".kora" / "toy"))
    p.add_argument("--steps", type=int, default=12, help="scaling: steps per adapter")
    p.add_argument("--curves", action="store_true", help="the two-adapter learning curves instead")
    p.add_argument("--time-limit", type=float, default=480.0, help="--curves: wall seconds of the whole command")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kora-multi-lora-") as tmp:
        result = curves(args.model, args.time_limit, Path(tmp)) if args.curves else scaling(args.model, args.steps,
                                                                                              Path(tmp))
    result["date"] = time.strftime("%Y-%m-%d")
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    summary = {k: v for k, v in result.items() if k != "adapters"}
    if "adapters" in result:
        summary["adapters"] = {n: {k: v for k, v in a.items() if k != "reward_curve"}
                               for n, a in result["adapters"].items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
