"""Kill the trainer, restart it on the same checkpoint.path: it resumes from the newest good LoRA-only
checkpoint and the steps after it reproduce the uninterrupted run exactly (deployment.async false, CPU,
same seed): every step's loss and reward equal (difference 0, not a tolerance) and the final adapter
bitwise equal. A corrupted newest checkpoint is refused with the reason and the previous one is used.

Runs (toy model, tiny steps, checkpoint.interval 2, 6 steps):
  A   uninterrupted, in its own checkpoint dir;
  B1  the same job, held inside step 5's generation (after checkpoint 4 is on disk) and SIGKILLed there
      with everything it started (Ray, workers, the engine);
  B2  B1 restarted on B's dir: resumes from step 4, runs 5..6;
  B3  B1 restarted on a copy of B's dir whose step 4 checkpoint has flipped bytes: refuses it, resumes
      from step 2, runs 3..6.
A and B1 run side by side, then B2 and B3.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kora_trainer.algorithm.lr_schedule import lr_at
from kora_trainer.algorithm.rewards import Sample
from kora_trainer.checkpoint import lora_only
from kora_trainer.config.sections import AlgorithmSpec
from trainkit import TIMEOUT_S, TOY_YAML, TrainRun, wait_all

STEPS, INTERVAL, SAMPLES_PER_STEP = 6, 2, 32
LR = yaml.safe_load(TOY_YAML.read_text())["algorithm"]["lr"]  # the runs' rate after the warmup
HOLD_ENV = "KORA_TEST_HOLD_AFTER_SAMPLES"
_scored = 0


def held_odd_first_digit(sample: Sample) -> float:
    """toy_rewards.odd_first_digit, except that with HOLD_ENV=n the (n+1)-th call blocks: the rollout
    worker then stops inside a known step, so the kill lands after a known checkpoint, not by timing."""
    global _scored
    _scored += 1
    hold = os.environ.get(HOLD_ENV)
    if hold and _scored > int(hold):
        time.sleep(3600)  # the test kills the run while it waits here
    return 1.0 if sample.response[:1] in ("1", "3", "5", "7", "9") else 0.0


# a warmup then a cosine decay: the resumed steps' rates are the uninterrupted run's (the schedule is the step's)
SCHEDULE = ["algorithm.lrDecayStyle=cosine", "algorithm.lrWarmupSteps=2", "algorithm.minLr=1e-4"]
JOB = [f"algorithm.numSteps={STEPS}", *SCHEDULE, "deployment.async=false", f"checkpoint.interval={INTERVAL}",
       "checkpoint.keep=2", "sync.deltaSkipThreshold=0", "data.customRewardPath=test_resume.held_odd_first_digit"]


def job(ckpt: Path) -> list[str]:
    return [*JOB, f"checkpoint.path={ckpt}"]


def adapter(ckpt: Path, step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s adapter as the run held it. The file is in checkpoint.dtype (bf16 by default), which rounds
    the toy's fp32 factors; their exact values are in the trainer state (checkpoint/precision.py)."""
    d = ckpt / f"step_{step:08d}"
    written = load_file(str(d / lora_only.ADAPTER))
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    exact = lora_only.load_dir(d).adapter
    assert exact.keys() == written.keys() and {t.dtype for t in exact.values()} == {torch.float32}
    return exact


def final_status(run: TrainRun) -> dict:
    final = [s for s in run.seen if s["phase"] == "Succeeded"]
    assert final, f"the final status was never read ({len(run.seen)} polls):\n{run.output[-2000:]}"
    return final[-1]


@pytest.mark.slow
def test_kill_and_resume_reproduce_the_uninterrupted_run(toy_dir, tmp_path):
    t0 = time.monotonic()
    ck_a, ck_b, ck_c = tmp_path / "ckpt-a", tmp_path / "ckpt-b", tmp_path / "ckpt-c"
    linger = {"KORA_CONTROL_LINGER_S": "60"}  # each run waits until the test has read its final status
    a = TrainRun(toy_dir, tmp_path / "a", *job(ck_a), env=linger)
    b1 = TrainRun(toy_dir, tmp_path / "b1", *job(ck_b), env={HOLD_ENV: str(4 * SAMPLES_PER_STEP)})
    try:
        # B1: wait for checkpoint 4 (it cannot get past scoring step 5's first sample), then kill it all
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and b1.running():
            if (ck_b / "latest").exists() and (ck_b / "latest").read_text().strip() == "step_00000004":
                break
            if a.running():
                a.poll()
            time.sleep(0.05)
        assert b1.running(), f"B1 exited before its checkpoint of step 4:\n{b1.output[-3000:]}"
        assert (ck_b / "latest").read_text().strip() == "step_00000004", b1.output[-3000:]
        b1.kill()
        wait_all([a])
    finally:
        for r in (a, b1):
            if r.running():
                r.kill()
    t_first = time.monotonic() - t0
    assert b1.steps() == [1, 2, 3, 4] and b1.events("summary") == []
    assert sorted(p.name for p in ck_b.glob("step_*")) == ["step_00000002", "step_00000004"]  # keep 2

    want = a.summary()
    rates = [e["lr"] for e in a.events("step")]
    alg = AlgorithmSpec.model_validate({"lr": LR, "numSteps": STEPS, "lrDecayStyle": "cosine", "lrWarmupSteps": 2,
                                        "minLr": 1e-4})
    assert rates == pytest.approx([lr_at(alg, i) for i in range(STEPS)], rel=1e-12)
    assert rates[0] == pytest.approx(LR / 2) and rates[1] == pytest.approx(LR) == rates[2]
    assert 1e-4 < rates[-1] < rates[-2]  # decaying towards minLr, which the step after the last would reach
    assert want["steps"] == STEPS and len(want["loss_curve"]) == STEPS and want["resumed_from_step"] is None
    assert final_status(a)["resumedFromStep"] is None
    assert sorted(p.name for p in ck_a.glob("step_*")) == ["step_00000004", "step_00000006"]

    # C: B's checkpoints with the newest one corrupted (same size, flipped bytes in the tensor data)
    shutil.copytree(ck_b, ck_c)
    blob = ck_c / "step_00000004" / "adapter.safetensors"
    data = bytearray(blob.read_bytes())
    for i in range(len(data) - 64, len(data) - 32):
        data[i] ^= 0xFF
    blob.write_bytes(bytes(data))

    b2 = TrainRun(toy_dir, tmp_path / "b2", *job(ck_b), env=linger)
    b3 = TrainRun(toy_dir, tmp_path / "b3", *job(ck_c), env=linger)
    t1 = time.monotonic()
    wait_all([b2, b3])
    t_second = time.monotonic() - t1

    for run, ckpt, k in ((b2, ck_b, 4), (b3, ck_c, 2)):
        out, got = run.output, run.summary()
        resumed = run.events("resume")
        assert [(e["step"], e["path"]) for e in resumed] == [(k, str(ckpt / f"step_{k:08d}"))], out[-3000:]
        assert run.steps() == list(range(k + 1, STEPS + 1))  # steps before the checkpoint are not redone
        assert got["first_step"] == k + 1 and got["resumed_from_step"] == k
        # exact: the same floats, not close ones
        assert got["loss_curve"] == want["loss_curve"][k:], (got["loss_curve"], want["loss_curve"])
        assert got["reward_curve"] == want["reward_curve"][k:]
        assert [e["lr"] for e in run.events("step")] == rates[k:]
        final_a, final_b = adapter(ck_a, STEPS), adapter(ckpt, STEPS)
        assert final_a.keys() == final_b.keys()
        assert all(torch.equal(final_a[n], final_b[n]) for n in final_a), "final adapters differ"
        status = final_status(run)
        assert status["resumedFromStep"] == k and status["step"] == STEPS
        saved = status["lastCheckpoint"]
        assert {f: saved[f] for f in ("path", "step")} == {"path": str(ckpt / f"step_{STEPS:08d}"), "step": STEPS}
        assert str(saved["time"]).endswith("Z")  # when it was written (the checkpoint age on /metrics)
        running = [s for s in run.seen if s["phase"] == "Running"]
        assert all(s["resumedFromStep"] == k and s["step"] >= k for s in running)
    refused = b3.events("resume")[0]["refused"]
    assert len(refused) == 1 and "step_00000004: adapter.safetensors fails its checksum" in refused[0]
    assert "checkpoint refused, falling back to an older one" in b3.output  # and the user is told
    assert b2.events("resume")[0]["refused"] == [] and "refused" not in b2.output
    print(f"A + B1 (killed after checkpoint 4) {t_first:.0f}s, B2 + B3 {t_second:.0f}s; "
          f"losses of steps 5-6 (B2) and 3-6 (B3) equal A's exactly: {want['loss_curve']}")
