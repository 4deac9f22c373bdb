"""`python -m kora_trainer.train` with weight sync on the fast path, as a user runs it: the toy, on-policy steps;
Disaggregated (sync/fast/distributed.py: a real gloo weight-update group to a real reference-engine process) and
Colocate (sync/fast/colocated.py: the engine's memory mapped once, shared memory on CPU, written in place).

The first sync (before step 1) goes through the HTTP path and plans the fast one; every step's push is a fast push
(summary `sync_paths`: the steps' pushes per path). What says the
push is right: before each step's first update the trainer compares its log-probs of the sampled tokens with the
engine's (`rollout_logp_gap_max`); fp32 on both sides, so a correct push leaves kernel noise, a wrong or missing
one the adapter's effect. `sync.fastPath=false` keeps the HTTP path for every push.
"""

from __future__ import annotations

import pytest

from trainkit import TrainRun, wait_all

ON_POLICY = ["deployment.async=false", "algorithm.numSteps=4"]
TRANSPORT = {"Disaggregated": "distributed", "Colocate": "colocated"}
GAP_BOUND = 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "deployment"), [
    pytest.param("Merge", "Disaggregated", marks=pytest.mark.full), ("Adapter", "Disaggregated"), ("Merge", "Colocate"),
    pytest.param("Adapter", "Colocate", marks=pytest.mark.full), ("EngineMerge", "Colocate")])
def test_fast_path_pushes_every_step_and_the_engine_serves_the_policy(toy_dir, tmp_path, mode, deployment):
    run = TrainRun(toy_dir, tmp_path, f"lora.syncMode={mode}", f"deployment.mode={deployment}", *ON_POLICY)
    wait_all([run], poll=False)
    summary = run.summary()
    assert summary["steps"] == 4 and summary["sync_mode"] == mode and summary["transport"] == TRANSPORT[deployment]
    assert any(n.startswith("fast path on") for n in run.notes()), run.output[-3000:]
    if deployment == "Colocate" and mode != "Adapter":  # no HTTP call per push (wire/colocated_words.py)
        assert any("push handshake in shared memory" in n for n in run.notes()), run.notes()
    paths = summary["sync_paths"]
    assert set(paths) == {"fast"} and paths["fast"]["pushes"] == 4, paths  # the steps' pushes (the first plans it)
    assert paths["fast"]["ms_p50"] > 0
    gap = summary["rollout_logp_gap_max"]
    assert gap is not None and gap < GAP_BOUND, f"engine vs trainer log-probs differ by {gap}"
    print(f"{mode}: sync_paths {paths}, gap {gap:.1e}")


@pytest.mark.slow
def test_fast_path_off_keeps_the_http_path(toy_dir, tmp_path):
    run = TrainRun(toy_dir, tmp_path, "lora.syncMode=Adapter", "sync.fastPath=false", "deployment.mode=Disaggregated",
                   *ON_POLICY)
    wait_all([run], poll=False)
    summary = run.summary()
    assert set(summary["sync_paths"]) == {"http"} and summary["sync_paths"]["http"]["pushes"] == 4
    assert not any("fast path" in n for n in run.notes())
    assert summary["rollout_logp_gap_max"] < GAP_BOUND
