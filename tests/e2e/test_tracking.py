"""The trackers and the trainer's /metrics on a real toy run (`python -m kora_trainer.train`, real Ray, a real
engine): TensorBoard event files read back with tensorboard's own reader hold every metric for every step, the
offline W&B run the same keys and values, and /metrics, scraped while the job runs, parses with prometheus_client's
own text parser and agrees with /status. W&B is offline (WANDB_MODE too): nothing leaves the machine."""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from localcluster import wait_for
from trackkit import STEP_TAGS, tensorboard_scalars, wandb_history
from trainkit import TIMEOUT_S, TrainRun, wait_all

STEPS = 3
SAMPLES_PER_STEP = 32  # trainkit.TINY: 8 prompts x 4 samples


def scrape(port: int) -> dict[str, float]:
    """One GET /metrics, no token (it is open like /healthz), parsed: sample name (+ labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def at_step_1_checkpointed(status: dict | None) -> bool:
    """Step 1 done and its checkpoint (written in the background) recorded."""
    return bool(status) and status.get("phase") == "Running" and status.get("step") == 1 \
        and (status.get("lastCheckpoint") or {}).get("step") == 1


@pytest.mark.slow
def test_tensorboard_wandb_and_metrics_on_a_toy_run(toy_dir, tmp_path):
    # the reward holds the run after step 1's samples (toy_rewards.odd_first_digit_gated) until the test has read
    # /status and /metrics of a running job, so that look does not race the job's last step
    gate = tmp_path / "gate"
    run = TrainRun(toy_dir, tmp_path, f"algorithm.numSteps={STEPS}", "deployment.async=false",
                   "tracking.wandb.enabled=true", "tracking.klToBase=true", f"checkpoint.path={tmp_path / 'ckpt'}",
                   "checkpoint.interval=1", "data.customRewardPath=toy_rewards.odd_first_digit_gated",
                   env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "KORA_TEST_GATE_FILE": str(gate),
                        "KORA_TEST_GATE_AFTER": str(SAMPLES_PER_STEP)})
    try:
        wait_for(lambda: not run.running() or at_step_1_checkpointed(run.poll()), timeout=TIMEOUT_S, interval=0.2,
                 what="the run Running at step 1, its checkpoint written")
        assert run.running(), run.output[-3000:]
        metrics = scrape(run.port)
    finally:
        gate.touch()
    wait_all([run])
    summary = run.summary()
    assert summary["steps"] == STEPS

    tb = tensorboard_scalars(run.run_dir / "tensorboard")
    missing = {tag: sorted(tb.get(tag, {})) for tag in STEP_TAGS if sorted(tb.get(tag, {})) != [1, 2, 3]}
    assert not missing, f"tags without a value at every step: {missing}"
    events = {e["step"]: e for e in run.events("step")}
    for step in (1, 2, 3):  # the values are the recorder's, not a second computation
        assert tb["critic/score/mean"][step] == pytest.approx(events[step]["reward_mean"], abs=1e-6)
        assert tb["actor/pg_loss"][step] == pytest.approx(events[step]["loss"], rel=1e-5, abs=1e-9)
        assert tb["sync/bytes"][step] == events[step]["sync"]["bytes"]
        assert tb["critic/score/min"][step] <= tb["critic/score/mean"][step] <= tb["critic/score/max"][step]
        assert tb["actor/entropy"][step] > 0 and tb["actor/kl_loss"][step] >= 0
        assert tb["actor/lr"][step] == pytest.approx(events[step]["lr"], rel=1e-6)  # the schedule's rate
        assert tb["perf/throughput"][step] > 0 and tb["timing_s/save_checkpoint"][step] > 0
    assert tb["actor/lr"][1] > tb["actor/lr"][2] > tb["actor/lr"][3] > 0  # toy.yaml decays it (cosine)
    assert tb["actor/kl_loss"][1] < tb["actor/kl_loss"][3]  # the adapter starts at the base and moves off it

    wb = wandb_history(run.run_dir)
    assert sorted(wb) == [1, 2, 3]
    for step, row in wb.items():
        assert set(row) == STEP_TAGS, f"step {step}: {set(row) ^ STEP_TAGS}"
        assert all(math.isclose(row[k], tb[k][step], rel_tol=1e-6, abs_tol=1e-6) for k in row)

    assert metrics["kora_trainer_step"] == 1 and metrics["kora_trainer_total_steps"] == STEPS
    assert metrics["kora_trainer_phase{phase=Running}"] == 1 and metrics["kora_trainer_phase{phase=Failed}"] == 0
    assert metrics["kora_trainer_last_sync_bytes"] > 0 and metrics["kora_trainer_last_sync_milliseconds"] > 0
    assert "kora_trainer_logp_gap_max" in metrics and "kora_trainer_reward_mean" in metrics
    assert "kora_trainer_checkpoint_age_seconds" in metrics and metrics["kora_trainer_checkpoint_step"] >= 1
    # the ETA on /status, from the measured rate
    running = [s for s in run.seen if s.get("phase") == "Running" and s.get("secondsPerStep")]
    assert running, "no /status answer carried the step rate"
    first = running[0]
    assert first["estimatedRemainingSeconds"] == round((STEPS - first["step"]) * first["secondsPerStep"])
    assert first["eta"].endswith(("s", "m", "h"))
