"""`python -m kora_trainer.train` end to end, as a user runs it: real local Ray, a real engine process,
real gloo / in-memory weight sync, the control plane polled over HTTP while the job runs. A short run on a
toy made in a temp dir (no pretraining: this checks the pipeline, not the learning curve — the full toy
curves are measured by the command in trainer/examples/toy.yaml), scored by a custom reward (toy_rewards.py).
The launch helpers (`TrainRun`, `wait_all`) are tests/trainkit.py's."""

from __future__ import annotations

import pytest

from trainkit import TrainRun, wait_all


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "deployment"), [("Adapter", "Disaggregated"), ("Merge", "Colocate"),
                                                  ("EngineMerge", "Disaggregated")])
def test_train_command_runs_and_reports(toy_dir, tmp_path, mode, deployment):
    run = TrainRun(toy_dir, tmp_path, f"lora.syncMode={mode}", f"deployment.mode={deployment}",
                   "algorithm.numSteps=3")
    wait_all([run])
    summary = run.summary()
    assert summary["steps"] == 3 and summary["sync_mode"] == mode
    assert summary["transport"] == ("colocated" if deployment == "Colocate" else "distributed")
    assert summary["sync_bytes_per_step"] > 0 and summary["sync_ms_p50"] > 0
    assert {"reward_first", "reward_last", "wall_s"} <= set(summary)
    assert len(summary["loss_curve"]) == 3 and summary["first_step"] == 1 and summary["resumed_from_step"] is None
    # the operator's view while it ran: progress moved and every sync was reported with its version
    running = [s for s in run.seen if s["phase"] == "Running"]
    assert running, f"the control plane never answered while the job ran ({len(run.seen)} polls)"
    last = running[-1]
    assert last["totalSteps"] == 3 and last["syncMode"] == mode and last["lastSync"]["adapterVersion"] is not None
    # every HTTP push carries a checksum, the fast path's only its verified ones (the first, every 10th): the
    # first push (HTTP) and step 1's (the first fast push, verified) both have one
    syncs = [run.events("start")[0]["sync"], run.events("step")[0]["sync"]]
    assert all(sync["checksum"] for sync in syncs), syncs
    assert last["lastSync"]["adapterVersion"] <= last["step"]
    assert last["resumedFromStep"] is None and last["lastCheckpoint"] is None  # no checkpoint.path: none
    assert run.steps() == [1, 2, 3] and all(e["total"] == 3 for e in run.events("step"))
    assert last.get("syncedStep") is not None and last["syncedStep"] >= last["lastSync"]["adapterVersion"]


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [pytest.param(0, marks=pytest.mark.full), 2])
def test_async_rollouts_lag_at_most_max_staleness(toy_dir, tmp_path, max_staleness):
    """deployment.async with maxStaleness k: the engines run up to k steps ahead of training, never more
    (k = 0 turns the overlap off). The lag is what the engines tagged their rollouts with."""
    run = TrainRun(toy_dir, tmp_path, "deployment.async=true", f"deployment.maxStaleness={max_staleness}",
                   "algorithm.numSteps=5")
    wait_all([run], poll=False)
    summary = run.summary()
    assert summary["steps"] == 5
    assert summary["rollout_lag_max"] <= max_staleness
    if max_staleness == 0:
        assert summary["rollout_lag_max"] == 0
