#!/usr/bin/env python3
"""The trainer under faults, in figures: >= 20 SIGKILLs of the whole trainer at random moments (a few during
startup, most inside its steps, some inside a checkpoint write), its engine dying mid-generate and
mid-sync, checkpoint.path filling up; one job (the toy, checkpoint every step, deployment.async false) resumed
after each, against the same job run uninterrupted beside it (the anchor: its losses, rewards and adapters); its
engine hanging without dying (SIGSTOP, or a wedged event loop) mid-generate and mid-sync, noticed within
rollout.engineHangSeconds.

    python bench/chaos_trainer.py [--kills 20] [--engine-kills 2] [--engine-hangs 2] [--disk 1] [--seed 18] [--out FILE]

What is checked on every attempt, and how, is tests/chaoskit.py's docstring (tests/e2e/test_chaos_trainer.py
runs a CI-sized plan). Prints a table and writes bench/results/chaos_trainer_<date>.json (figures, the plan,
every attempt: its fault, the checkpoint it had to resume from and the one it did, its steps, what it said).
Exit 1 when any check failed. The disk fault needs a tmpfs (root); without one it is left out and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT / "trainer", ROOT / "tests", ROOT / "tests" / "e2e"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from chaoskit import Chaos, steps_for  # noqa: E402  (tests/chaoskit.py, after the path above)

ROWS = [  # (figure, what it counts)
    ("trainer_kills", "SIGKILLs of the trainer's whole session"),
    ("kills_startup", "  of them during startup (random moment in the first 25 s)"),
    ("kills_steps", "  inside the steps (random 0-2.5 s after ready)"),
    ("kills_write", "  inside a checkpoint write"),
    ("kills_during_checkpoint_write", "kills that left a checkpoint write unfinished"),
    ("torn_writes_seen_on_disk", "torn writes on disk at a restart"),
    ("torn_loaded", "restarts that loaded anything but the newest good checkpoint"),
    ("restarts", "restarts"),
    ("resumes_from_verified_checkpoint", "  resumed from a checkpoint that verifies and equals the anchor's"),
    ("fresh_starts", "  started fresh (no checkpoint yet)"),
    ("killed_before_loading", "  killed before they reached the checkpoint load"),
    ("engine_kills_mid_generate", "engine deaths inside /generate"),
    ("engine_kills_mid_sync", "engine deaths inside a weight push"),
    ("engine_notice_s_max", "  slowest notice, engine death -> trainer Failed (s)"),
    ("engine_hangs_mid_generate", "engine hangs inside /generate (SIGSTOP / wedged, in turn)"),
    ("engine_hangs_mid_sync", "engine hangs inside a weight push (HTTP path / fast path, in turn)"),
    ("engine_hang_s", "  rollout.engineHangSeconds of the runs (s)"),
    ("engine_hang_notice_s_max", "  slowest notice, engine hang -> trainer Failed (s)"),
    ("disk_full_attempts", "checkpoint.path full (ENOSPC, latest kept)"),
    ("steps_run_in_all", "steps run over all attempts"),
    ("steps_differing_from_uninterrupted", "steps whose loss/reward differ from the anchor's"),
    ("final_adapter_equal", "final adapter bit-equal to the uninterrupted run's"),
    ("problems", "checks failed"),
    ("reference_s", "the uninterrupted run (s)"),
    ("chaos_s", "all attempts (s)"),
]


def make_plan(kills: int, engine_kills: int, disk: int, seed: int, engine_hangs: int = 0) -> list[str]:
    """`kills` trainer kills (10% startup, 30% at a checkpoint write, the rest in the steps), engine deaths and
    hangs, and disk faults, shuffled (seeded) so that each fault meets a different point of the job."""
    startup = max(1, kills // 10)
    write = max(1, (kills * 3) // 10)
    plan = (["startup"] * startup + ["write"] * write + ["steps"] * (kills - startup - write)
            + ["engine-generate", "engine-sync"] * engine_kills
            + ["engine-hang-generate", "engine-hang-sync"] * engine_hangs + ["disk"] * disk)
    random.Random(seed).shuffle(plan)
    return plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs of the trainer (default 20)")
    ap.add_argument("--engine-kills", type=int, default=2, help="engine deaths of each kind (default 2)")
    ap.add_argument("--engine-hangs", type=int, default=2, help="engine hangs of each kind (default 2: each kind of "
                    "hang once per place)")
    ap.add_argument("--disk", type=int, default=1, help="full-disk attempts (default 1)")
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--out", default=None, help="default bench/results/chaos_trainer_<date>.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from kora_trainer.toys.lm import make_toy

    plan = make_plan(args.kills, args.engine_kills, args.disk, args.seed, args.engine_hangs)
    steps = steps_for(plan)
    with tempfile.TemporaryDirectory(prefix="kora-chaos-") as tmp:
        toy = Path(tmp) / "toy"
        make_toy(toy, target=0.0)
        result = Chaos(toy, Path(tmp) / "work", steps=steps, seed=args.seed).run(plan)
    figures = result.figures()
    print(f"{'figure':<66} value")
    for key, label in ROWS:
        print(f"{label:<66} {figures[key]}")
    for problem in result.problems():
        print(f"PROBLEM: {problem}")
    out = Path(args.out or ROOT / "bench" / "results" / f"chaos_trainer_{time.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"bench": "chaos_trainer", "command": " ".join(["python", "bench/chaos_trainer.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(), "seed": args.seed,
              "plan": plan, **result.as_dict()}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 1 if result.problems() else 0


if __name__ == "__main__":
    raise SystemExit(main())
