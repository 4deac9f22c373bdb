"""The recorder's trackers without a run: a multi-adapter job's steps land in one series per adapter (`<name>/...`)
at each adapter's own step, read back with tensorboard's reader."""

from __future__ import annotations

import time

import pytest

from kora_trainer.backends.multi_lora import AdapterStepMetrics
from kora_trainer.recorder import StepRecorder, read_events
from kora_trainer.tracking.sinks import TensorBoardSink
from trackkit import tensorboard_scalars


def adapter_step(name: str, step: int, reward: float) -> dict:
    return AdapterStepMetrics(name=name, step=step, reward_mean=reward, samples=8, loss=-0.1, clip_frac=0.0, kl=0.0,
                              grad_norm=1.0, response_len=4.0, rollout_logp_gap_max=1e-6, rollout_version_lag=0,
                              train_ms=20.0, reward_std=0.5, reward_min=0.0, reward_max=1.0, entropy=1.2,
                              lr=2e-3).as_dict()


SYNC = {"pushed": True, "bytes": 1024, "ms": 3.0, "adapter_version": 1, "checksum": "c", "what": "adapter",
        "path": "http"}


def test_each_adapter_gets_its_own_series(tmp_path):
    rec = StepRecorder(tmp_path / "run", 0, "Adapter", time.monotonic(), sinks=[TensorBoardSink(tmp_path / "tb")])
    # two adapters stepping at their own pace: a three times, b once
    for step, reward in ((1, 0.25), (2, 0.5), (3, 0.75)):
        rec.adapter_stepped(adapter_step("a", step, reward), 100.0, {**SYNC, "adapter_version": step})
    rec.adapter_stepped(adapter_step("b", 1, 0.125), 80.0, SYNC)
    rec.adapter_checkpointed("a", 3, "/ckpt/a/step_3", 40.0)
    rec.close()
    tb = tensorboard_scalars(tmp_path / "tb")
    assert tb["a/critic/score/mean"] == {1: 0.25, 2: 0.5, 3: 0.75} and tb["b/critic/score/mean"] == {1: 0.125}
    assert tb["a/sync/adapter_version"] == {1: 1.0, 2: 2.0, 3: 3.0} and tb["b/timing_s/gen"] == {1: pytest.approx(0.08)}
    # event files hold float32: approx
    assert tb["a/timing_s/save_checkpoint"] == {3: pytest.approx(0.04)} and "b/timing_s/save_checkpoint" not in tb
    assert "a/actor/kl_loss" not in tb  # not measured (klCoef 0): left out, not logged as 0
    assert {t.split("/", 1)[0] for t in tb} == {"a", "b"}  # nothing outside a per-adapter series
    events = read_events(tmp_path / "run")
    assert [(e["adapter"], e["step"]) for e in events if e["event"] == "adapter_step"] == [
        ("a", 1), ("a", 2), ("a", 3), ("b", 1)]
