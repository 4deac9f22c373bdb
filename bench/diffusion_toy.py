#!/usr/bin/env python3
"""The diffusion toy's reward rise through the train command, in each LoRA sync mode (issue 23).

Each run is the command a user types (`python -m kora_trainer.train --config trainer/examples/diffusion_toy.yaml
lora.syncMode=M`), timed whole from here, the engine's start included. What it reports per run: the command's
seconds, the sampled training reward of the first and last 10 steps, the median gen / train / sync times, and the
anchor — the fixed-noise evaluation (every prompt x 4 images, the same draws before and after:
backends/diffusion/train_loop.evaluate) of the base against the run's final checkpoint, which is the number a rise is
claimed on (the sampled reward of 8 random prompts a step is noisy).

    python bench/diffusion_toy.py --out bench/results/diffusion_toy_$(date +%F).json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "trainer"), str(ROOT / "engine")]
CONFIG = ROOT / "trainer" / "examples" / "diffusion_toy.yaml"
WINDOW = 10


def evaluate(toy_dir: Path, ckpt: Path | None, cfg: Any) -> float:
    """evaluate() of the toy with the job's adapter: the checkpoint's (None: B = 0, the base policy)."""
    import torch

    from kora_trainer.backends.diffusion.train_loop import evaluate as fixed_noise_eval
    from kora_trainer.checkpoint import lora_only
    from kora_trainer.lora.diffusers import apply_diffusion_lora
    from kora_trainer.lora.model import adapter_tensors
    from kora_trainer.recipes.flow_grpo import settings_of
    from kora_trainer.toys.diffusion import load_diffusion_toy

    torch.set_num_threads(1)
    toy = load_diffusion_toy(toy_dir)
    toy.transformer.eval()
    apply_diffusion_lora(toy.transformer, cfg.lora.rank, cfg.lora.alpha,
                         [t.value for t in cfg.diffusion.target_modules], str(cfg.diffusion.lora_init))
    if ckpt is not None:
        saved = lora_only.load_latest(ckpt)
        assert saved is not None, f"no checkpoint under {ckpt}"
        with torch.no_grad():
            for name, t in adapter_tensors(toy.transformer):
                t.copy_(saved.adapter[name])
    return fixed_noise_eval(toy, settings_of(cfg))


def run_one(mode: str, toy: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from kora_trainer.config import load_config
    from kora_trainer.recorder import read_events

    run_dir, ckpt = work / f"run-{mode}", work / f"ckpt-{mode}"
    overrides = [f"model.path={toy}", f"data.path={toy}/prompts.jsonl", f"lora.syncMode={mode}",
                 f"algorithm.numSteps={args.steps}", f"checkpoint.path={ckpt}", f"checkpoint.interval={args.steps}",
                 *args.set]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kora_trainer.train", "--config", str(CONFIG), "--run-dir",
                           str(run_dir), *overrides], capture_output=True, text=True, cwd=work)
    command_s = round(time.monotonic() - t0, 1)
    if proc.returncode != 0:
        return {"mode": mode, "rc": proc.returncode, "error": proc.stdout[-2000:] + proc.stderr[-2000:]}
    events = read_events(run_dir)
    steps = [e for e in events if e["event"] == "step"]
    rewards = [e["reward_mean"] for e in steps]
    cfg, _ = load_config(str(CONFIG), overrides)

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 2)

    before, after = evaluate(toy, None, cfg), evaluate(toy, ckpt, cfg)
    return {"mode": mode, "rc": 0, "steps": len(steps), "command_s": command_s,
            "ready_s": next(e["wall_s"] for e in events if e["event"] == "start"),
            "reward_first": round(statistics.fmean(rewards[:WINDOW]), 4),
            "reward_last": round(statistics.fmean(rewards[-WINDOW:]), 4),
            "eval_before": round(before, 4), "eval_after": round(after, 4), "eval_rise": round(after - before, 4),
            "gen_ms_p50": median([e["gen_ms"] for e in steps]), "train_ms_p50": median([e["train_ms"] for e in steps]),
            "sync_ms_p50": median([e["sync"]["ms"] for e in steps]), "sync_bytes": steps[0]["sync"]["bytes"],
            "logp_gap_max": max(e["rollout_logp_gap_max"] for e in steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="EngineMerge,Merge")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for every run")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="diffusion-toy-"))
    toy = work / "toy"
    from kora_trainer.toys.diffusion import make_diffusion_toy

    make_diffusion_toy(toy)  # made once, before the timed runs, as `kora make-toy --diffusion` would
    runs = []
    for mode in args.modes.split(","):
        r = run_one(mode, toy, work, args)
        print(json.dumps(r), flush=True)
        runs.append(r)
    record = {"bench": "diffusion_toy", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": "python bench/diffusion_toy.py " + " ".join(sys.argv[1:]), "steps": args.steps,
              "overrides": args.set, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
