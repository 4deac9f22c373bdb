"""Issue 18 item 4, the serving check through the real train command on the toy: an engine that drops the
adapter (the reference engine's fault switch KORA_ENGINE_FAULT_DROP_ADAPTER: it acknowledges every push, checksum
and version tag included, and serves the base model — no real route can make it keep doing so, since each push
reloads the adapter) is seen on /status (servingCheck: the gap, the version it was measured at), and the run
stops Failed after sync.servedBadStepsToFail bad steps with a message naming the gap, the threshold and the
version. A healthy run beside it keeps every gap under the same threshold. The operator's reading of the runs'
real final /status answers (PolicyServed True for the healthy run; False, with a Warning event on that change, at
the broken one's stop) closes it; the
operator's unit side is tests/unit/test_serving_check.py."""

from __future__ import annotations

import pytest

from kora_engine.lm.adapter_registry import DROP_ADAPTER_ENV
from kora_operator.api.job import LoRATrainingJob
from kora_operator.conditions import transitions
from kora_operator.progress import progress_conditions, progress_of
from specs import valid_job
from trainkit import TrainRun, wait_all

GAP_MAX = 1e-4  # fp32 engine vs trainer, as in the other toy tests: the toy's young adapter moves log-probs little
ARGS = ("lora.syncMode=Adapter", "deployment.mode=Disaggregated", "deployment.async=false", "algorithm.numSteps=6",
        f"sync.servedLogpGapMax={GAP_MAX}", "sync.servedBadStepsToFail=2", "sync.deltaSkipThreshold=0")
LINGER = {"KORA_CONTROL_LINGER_S": "60"}  # the final status is read before the control plane stops


@pytest.mark.slow
def test_an_engine_that_drops_the_adapter_stops_the_run(toy_dir, tmp_path):
    drop = {DROP_ADAPTER_ENV: "kora-policy"}  # the engine keeps acknowledging, and serves the base model
    broken = TrainRun(toy_dir, tmp_path / "broken", *ARGS, env={**LINGER, **drop})
    healthy = TrainRun(toy_dir, tmp_path / "healthy", *ARGS, env=LINGER)
    wait_all([broken, healthy])
    assert healthy.proc.returncode == 0, healthy.output[-3000:]
    gaps = [e["rollout_logp_gap_max"] for e in healthy.events("step")]
    assert len(gaps) == 6 and all(g is not None and g <= GAP_MAX for g in gaps), gaps
    assert healthy.seen[-1]["servingCheck"]["badSteps"] == 0

    assert broken.proc.returncode != 0, broken.output[-3000:]
    final = broken.seen[-1]
    assert final["phase"] == "Failed", final
    check = final["servingCheck"]
    assert check["logpGapMax"] > GAP_MAX and check["badSteps"] == 2 and check["threshold"] == GAP_MAX
    assert check["version"] == check["step"] - 1  # the rollouts came from the version the engine claimed
    steps = broken.steps()
    assert steps[-1] == check["step"] < 6, steps  # stopped early, not trained to the end
    msg = final["message"]
    assert "PolicyNotServed" in msg and "sync.servedLogpGapMax 0.0001" in msg, msg
    assert f"policy version {check['version']}" in msg and "dropped or never loaded the adapter" in msg, msg
    # the gap is the adapter's whole effect: step 1's adapter (B = 0) equals the base, so that step is clean
    assert broken.events("step")[0]["rollout_logp_gap_max"] <= GAP_MAX
    # the operator's reading of the runs' real answers: True for the healthy one, False + a Warning for this one
    spec = LoRATrainingJob.model_validate(valid_job("p")).spec

    def served(status):
        cond = next(c for c in progress_conditions(progress_of(status), spec) if str(c.type) == "PolicyServed")
        return {"type": str(cond.type), "status": cond.status, "reason": str(cond.reason), "message": cond.message}

    before, after = served(healthy.seen[-1]), served(final)  # polls are too sparse to catch step 1 for sure
    assert before["status"] == "True" and after["status"] == "False" and after["reason"] == "PolicyNotServed"
    assert [(t.type, t.reason) for t in transitions([before], [after])] == [("Warning", "PolicyNotServed")]
