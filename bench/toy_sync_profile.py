"""The toy's weight pushes through the real train command, at this checkout and at other commits' trees, side by
side on one machine, each push profiled (issue 17 item 4: where a sync's milliseconds go, and whether a slower
sync between two runs was the code or the machine).

Each run is `python -m kora_trainer.train` with backend megatron, Colocate, deployment.async false, on the toy this
checkout makes (the same weights for every tree), with that tree's trainer on PYTHONPATH and
bench/sync_profile/sitecustomize.py in front of it: every push of the trainer's sender is profiled (cProfile) in
the Ray actor that makes it. Another commit's tree is `git archive REV trainer tests | tar -x -C DIR`.

    python bench/toy_sync_profile.py --tree old=DIR --modes Adapter,Merge --steps 6 --out RESULT.json
    python bench/toy_sync_profile.py --no-profile ...     # the same runs without the profiler (its overhead
                                                          # is in the pushes' own times)

The current checkout runs with `--head-set` (default sync.fastPath=false: the HTTP path, which the older trees
had; `--head-set ''` for today's default). GPU only (megatron).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROFILER = REPO / "bench" / "sync_profile"
sys.path[:0] = [str(REPO / "trainer"), str(REPO / "engine"), str(REPO / "tests"), str(PROFILER)]

from trainkit import TINY  # noqa: E402 (the toy tests' small steps; after the path above)

# the GPU tests' megatron settings (tests/gpu/test_train_megatron.MEGATRON: a test module, not imported)
MEGATRON = ["backend=megatron", "deployment.async=false", "rollout.gpusPerEngine=1", "sync.deltaSkipThreshold=0"]


def train(tree: Path, toy: Path, work: Path, overrides: list[str], profile: bool, timeout_s: float) -> dict:
    from kora_trainer.wire.ports import free_port

    work.mkdir(parents=True, exist_ok=True)
    prof_dir = work / "prof"
    cmd = [sys.executable, "-m", "kora_trainer.train", "--config", str(tree / "trainer/examples/toy.yaml"),
           "--control-port", str(free_port()), "--run-dir", str(work / "run"), f"model.path={toy}",
           f"data.path={toy}/train.jsonl", *TINY, *overrides]
    path = [str(PROFILER)] if profile else []
    env = {**os.environ, "KORA_CONTROL_TOKEN": "bench",
           "PYTHONPATH": os.pathsep.join([*path, str(tree / "trainer"), str(tree / "engine"),
                                          str(tree / "tests" / "e2e"), str(tree / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    if profile:
        env["KORA_SYNC_PROFILE"] = str(prof_dir)
    for inherited in ("RAY_ADDRESS", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(inherited, None)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout + proc.stderr
    (work / "out.log").write_text(out)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith('{"event": "summary"')]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}", "tail": out[-3000:]}
    summary = lines[-1]
    # every tree prints a progress line per step: "... | sync 12ms 360448B v3 | ..." (whole milliseconds)
    steps = [float(m) for m in re.findall(r"\| sync (\d+)ms ", out)]
    result = {"command": " ".join(cmd[1:]), "wall_s": round(time.monotonic() - t0, 1),
              "sync_ms_p50": summary.get("sync_ms_p50"), "rollout_logp_gap_max": summary.get("rollout_logp_gap_max"),
              "sync_ms_steps": steps, "sync_paths": summary.get("sync_paths")}
    if profile:
        from report import summary as prof_summary

        result["profile"] = [prof_summary(p, 30) for p in sorted(prof_dir.glob("sync-*.prof"))]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], help="LABEL=DIR: another commit's trainer + tests")
    ap.add_argument("--modes", default="Adapter,Merge")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--head-set", default="sync.fastPath=false", help="overrides for this checkout's runs only")
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every run (e.g. backend=torch on a CPU)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="each tree's runs this many times, interleaved")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from kora_trainer.toys.lm import make_toy

    trees = {"HEAD": REPO, **{t.split("=", 1)[0]: Path(t.split("=", 1)[1]).resolve() for t in args.tree}}
    work = Path(tempfile.mkdtemp(prefix="kora-sync-profile-"))
    toy = work / "toy"
    make_toy(toy, target=0.0, dataset="train.jsonl")
    res: dict = {"bench": "toy_sync_profile", "argv": sys.argv[1:], "profiled": not args.no_profile, "runs": []}
    for r in range(args.rounds):
        for mode in args.modes.split(","):
            for label, tree in trees.items():
                extra = [s for s in args.head_set.split(",") if s] if label == "HEAD" else []
                over = [*MEGATRON, f"lora.syncMode={mode}", "deployment.mode=Colocate",
                        f"algorithm.numSteps={args.steps}", *extra, *args.set]
                one = train(tree, toy, work / f"{label}-{mode}-{r}", over, not args.no_profile, args.timeout)
                one.update(tree=label, mode=mode, round=r)
                res["runs"].append(one)
                print(json.dumps({k: one.get(k) for k in ("tree", "mode", "round", "sync_ms_p50", "sync_ms_steps",
                                                          "wall_s", "rollout_logp_gap_max", "error")}), flush=True)
                if "error" in one:
                    print(one["tail"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
