"""Data-parallel scaling of the trainer: step time and the DP gradient all-reduce at parallelism.data 1 vs N, the
same job through the product (`python -m kora_trainer.train`, its event file), one run after the other on one
machine. The anchor is data 1 in the same run: `train_ratio` = median train_ms at data N / at data 1 (ideal
1/N when the ranks have cores or GPUs of their own), `allreduce_share` = the all-reduce's part of data N's
train_ms.

    python bench/dp_scaling.py [--model .kora/toy] [--steps 12] [--data 2] [--gpu] [--out FILE]

CPU (default): the toy, gloo, the reference engine on CPU, one torch thread per process (2 ranks + 2 engines
on a 2-core machine share those cores: the ratio then shows contention, not scaling). --gpu: one GPU per rank,
Colocate (each engine on its rank's GPU), NCCL; needs N GPUs. The first two steps are left out of the medians
(warm-up). Results: bench/results/dp_scaling_*.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOY_YAML = REPO / "trainer" / "examples" / "toy.yaml"
WARMUP = 2


def run(model: str, data: int, steps: int, gpu: bool, work: Path) -> dict[str, float]:
    """One trainer run; the medians of its step events (warm-up steps left out)."""
    from kora_trainer.recorder import read_events

    run_dir = work / f"data{data}"
    dataset = next((f for f in ("train.jsonl", "train.parquet") if (Path(model) / f).exists()), "train.jsonl")
    overrides = [f"model.path={model}", f"data.path={model}/{dataset}", f"parallelism.data={data}",
                 f"algorithm.numSteps={steps}", f"rollout.numEngines={data}", "deployment.mode=Colocate",
                 "deployment.async=false", f"rollout.gpusPerEngine={1 if gpu else 0}"]
    cmd = [sys.executable, "-m", "kora_trainer.train", "--config", str(TOY_YAML), "--run-dir", str(run_dir),
           "--control-port", "0", *overrides]
    path = [str(REPO / "trainer"), str(REPO / "engine"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"data {data}: the trainer exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    steps_ev = [e for e in read_events(run_dir) if e["event"] == "step"][WARMUP:]
    if not steps_ev:
        raise SystemExit(f"data {data}: no step after the {WARMUP} warm-up steps: raise --steps")

    def med(key: str) -> float:
        return round(statistics.median(float(e[key]) for e in steps_ev), 2)

    walls = [b["wall_s"] - a["wall_s"] for a, b in itertools.pairwise(steps_ev)]
    return {"data": data, "train_ms": med("train_ms"), "dp_allreduce_ms": med("dp_allreduce_ms"),
            "gen_ms": med("gen_ms"), "step_wall_ms": round(statistics.median(walls) * 1000, 1) if walls else 0.0,
            "steps": len(steps_ev), "run_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / ".kora" / "toy"),
                   help="toy dir (made there if missing, its dataset as JSON lines)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--data", type=int, default=2, help="the data-parallel size compared with 1")
    p.add_argument("--gpu", action="store_true", help="one GPU per rank (and its engine beside it)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    if not (Path(args.model) / "config.json").exists():  # JSON lines: the GPU image has no pyarrow for parquet
        sys.path[:0] = [str(REPO / "trainer"), str(REPO / "engine")]
        from kora_trainer.toys.lm import make_toy

        make_toy(args.model, dataset="train.jsonl")
    with tempfile.TemporaryDirectory(prefix="kora-dp-") as tmp:
        one, many = (run(args.model, d, args.steps, args.gpu, Path(tmp)) for d in (1, args.data))
    result = {"bench": "dp_scaling", "device": "gpu" if args.gpu else "cpu", "cores": os.cpu_count(),
              "data1": one, f"data{args.data}": many,
              "train_ratio": round(many["train_ms"] / one["train_ms"], 3),
              "step_wall_ratio": round(many["step_wall_ms"] / one["step_wall_ms"], 3) if one["step_wall_ms"] else None,
              "allreduce_share": round(many["dp_allreduce_ms"] / many["train_ms"], 4) if many["train_ms"] else None}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
