#!/usr/bin/env python3
"""The diffusion job on one GPU, on a transformer of realistic shape: each sync strategy's push time through the
train command against one device copy of the same bytes, measured in the same run (issue 23).

The model is `kora make-toy --diffusion --diffusion-shape sd3-medium` (SD3-medium's transformer: 24 joint blocks,
2.03B parameters, random init, fp32) with a small latent side (`--sample-size`, default 32) so the rollouts stay
short: a push's bytes depend on the weights, not on the image size. Each run is the command a user types
(`python -m kora_trainer.train --config trainer/examples/diffusion_toy.yaml` with the overrides below and
`rollout.gpusPerEngine=1`: the engine and the trainer share the GPU, a push is CUDA IPC handles). Per mode it reports
the push's bytes and buckets, its median time over the steps (the events' sync.ms: serialize, the HTTP calls, the
engine's fold / copy and its synchronize), the anchor — the median time of one device-to-device copy of the same
number of bytes (`torch.Tensor.copy_`, the device synchronised around it) — and their ratio (for EngineMerge also
against one copy of its A/B bytes plus the adapted weights' bytes, which its engine rewrites), with the step's other
phases and the engine-vs-trainer log-prob gap (the engine served every pushed policy when it is ~0).

    python bench/diffusion_gpu.py --out bench/results/diffusion_gpu_$(date +%F).json
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
sys.path.insert(0, str(ROOT / "bench"))
CONFIG = ROOT / "trainer" / "examples" / "diffusion_toy.yaml"


def copy_ms(nbytes: int, reps: int) -> float:
    """The anchor: the median wall time of one device copy of `nbytes` bytes on cuda:0."""
    import torch

    from _timing import wall_ms

    device = torch.device("cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    median, _ = wall_ms(lambda: dst.copy_(src), reps, device)
    return median


def run_one(mode: str, model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from kora_trainer.recorder import read_events

    run_dir = work / f"run-{mode}"
    overrides = [f"model.path={model}", f"data.path={model}/prompts.jsonl", f"lora.syncMode={mode}",
                 "rollout.gpusPerEngine=1", f"algorithm.numSteps={args.steps}",
                 f"algorithm.rolloutBatchSize={args.prompts}", f"algorithm.nSamplesPerPrompt={args.samples}",
                 f"diffusion.numInferenceSteps={args.denoise}", f"sync.bufferSize={args.buffer}", *args.set]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kora_trainer.train", "--config", str(CONFIG), "--run-dir",
                           str(run_dir), *overrides], capture_output=True, text=True, cwd=work)
    command_s = round(time.monotonic() - t0, 1)
    if proc.returncode != 0:
        return {"mode": mode, "rc": proc.returncode, "error": proc.stdout[-3000:] + proc.stderr[-3000:]}
    events = read_events(run_dir)
    start = next(e for e in events if e["event"] == "start")
    steps = [e for e in events if e["event"] == "step"]
    pushes = [e["sync"]["ms"] for e in steps]
    nbytes = steps[0]["sync"]["bytes"]
    anchor = copy_ms(nbytes, args.reps)
    push = statistics.median(pushes)
    return {"mode": mode, "rc": 0, "steps": len(steps), "command_s": command_s, "device": start.get("device"),
            "sync_bytes": nbytes, "sync_buckets": steps[0]["sync"].get("buckets"),
            "sync_what": steps[0]["sync"].get("what"),
            "push_ms_p50": round(push, 2), "push_ms_all": [round(v, 2) for v in pushes],
            "copy_ms_p50": round(anchor, 3), "ratio": round(push / anchor, 2),
            "gen_ms_p50": round(statistics.median(e["gen_ms"] for e in steps), 1),
            "train_ms_p50": round(statistics.median(e["train_ms"] for e in steps), 1),
            "logp_gap_max": max(e["rollout_logp_gap_max"] for e in steps),
            "first_sync_line": next((line for line in proc.stdout.splitlines() if "weight sync v1" in line), None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="EngineMerge,Merge")
    p.add_argument("--model", default=None, help="a model `kora make-toy --diffusion --diffusion-shape sd3-medium` "
                                                 "wrote (default: made here, once, before the runs)")
    p.add_argument("--sample-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--denoise", type=int, default=4)
    p.add_argument("--buffer", default="512Mi", help="sync.bufferSize")
    p.add_argument("--reps", type=int, default=20, help="anchor copies timed")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for every run")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="diffusion-gpu-"))
    model = Path(args.model) if args.model else work / "sd3-medium"
    made_s = None
    if args.model is None:
        from kora_trainer.toys.diffusion import make_diffusion_toy

        t0 = time.monotonic()
        make_diffusion_toy(model, shape="sd3-medium", sample_size=args.sample_size)
        made_s = round(time.monotonic() - t0, 1)
    info = json.loads((model / "toy.json").read_text())
    runs = []
    for mode in args.modes.split(","):
        r = run_one(mode, model, work, args)
        print(json.dumps(r), flush=True)
        runs.append(r)
    by_mode = {r["mode"]: r for r in runs if r["rc"] == 0}
    if "EngineMerge" in by_mode and "Merge" in by_mode:  # IPC merge's own floor: its A/B bytes + the weights it folds
        em, weights = by_mode["EngineMerge"], by_mode["Merge"]["sync_bytes"]
        em["copy_ab_plus_weights_ms_p50"] = round(copy_ms(em["sync_bytes"] + weights, args.reps), 3)
        em["ratio_vs_ab_plus_weights"] = round(em["push_ms_p50"] / em["copy_ab_plus_weights_ms_p50"], 2)
    import torch

    record = {"bench": "diffusion_gpu", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": "python bench/diffusion_gpu.py " + " ".join(sys.argv[1:]),
              "gpu": torch.cuda.get_device_name(0), "model": {"params": info["params"], "shape": info.get("shape"),
                                                             "transformer": info["transformer"], "made_s": made_s},
              "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
