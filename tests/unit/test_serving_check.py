"""The serving check (issue 18 item 4): the trainer's decision (kora_trainer/serving_check.py: N consecutive
steps above sync.servedLogpGapMax stop the run; a step without a gap neither counts nor resets), /status
carrying it, and the operator's PolicyServed condition and its Warning event (kora_operator/progress.py)."""

from __future__ import annotations

import pytest

from kora_operator.api.job import LoRATrainingJob
from kora_operator.conditions import transitions
from kora_operator.progress import progress_conditions, progress_of
from kora_trainer.config.sections import SyncSpec
from kora_trainer.control_plane import Progress
from kora_trainer.serving_check import PolicyNotServed, ServingCheck
from specs import valid_job

OK, BAD = 3e-6, 0.9  # fp32 kernel noise; a dropped adapter's effect


def test_defaults_are_the_documented_ones():
    s = SyncSpec()
    assert s.served_logp_gap_max == 0.25 and s.served_bad_steps_to_fail == 3


def test_n_consecutive_bad_steps_stop_and_the_message_says_why():
    check = ServingCheck(threshold=0.25, bad_steps_to_fail=3)
    for step in (1, 2):
        status = check.observe(step, step - 1, BAD, 0.1)
        assert status["badSteps"] == step
        check.verdict(status)  # not yet
    status = check.observe(3, 2, BAD, 0.1)
    assert status["badSteps"] == 3  # /status gets the failing step's count before the stop
    with pytest.raises(PolicyNotServed) as e:
        check.verdict(status)
    msg = str(e.value)
    for part in ("3 consecutive steps", "step 3", "sync.servedLogpGapMax 0.25", "last 0.9", "policy version 2",
                 "dropped or never loaded the adapter"):
        assert part in msg, (part, msg)


def test_a_good_step_resets_and_a_step_without_gap_neither_counts_nor_resets():
    check = ServingCheck(threshold=0.25, bad_steps_to_fail=2)
    check.observe(1, 0, BAD, 0.1)
    assert check.observe(2, 1, OK, 1e-6) == {"logpGapMax": OK, "logpGapMean": 1e-6, "version": 1, "step": 2,
                                              "threshold": 0.25, "badSteps": 0}
    check.verdict(check.observe(3, 2, BAD, 0.1))
    none = check.observe(4, 2, None, None)  # async: rollouts of an older version
    assert none is None and check.bad_steps == 1
    check.verdict(none)
    with pytest.raises(PolicyNotServed):
        check.verdict(check.observe(5, 4, BAD, 0.1))


def test_an_adapters_check_names_it_in_its_state_and_its_stop(tmp_path):
    """Multi-adapter jobs: one check per adapter, its name in the check (the job's /status servingCheck), on its
    state (GET /adapter_runs/<name>) and in the stop's message."""
    from kora_trainer.config.sections import AdapterRunConfig
    from specs import multi_adapter_registry

    registry, data = multi_adapter_registry(tmp_path)
    registry.register("b", AdapterRunConfig.model_validate({"rank": 8, "data": {"path": str(data)}}))
    check = ServingCheck(threshold=0.25, bad_steps_to_fail=2, adapter="b")
    first = check.observe(2, 1, BAD, None)
    assert first is not None and first["adapter"] == "b"
    registry.served("b", first)
    state = registry.get("b").model_dump(by_alias=True)
    assert state["servingCheck"]["adapter"] == "b" and state["servingCheck"]["badSteps"] == 1, state
    p = Progress(0, "Adapter")
    p.update(servingCheck=first)
    assert p.snapshot()["servingCheck"]["adapter"] == "b"  # the job's /status takes it
    with pytest.raises(PolicyNotServed) as e:
        check.verdict(check.observe(3, 2, BAD, None))
    msg = str(e.value)
    for part in ("adapter b: the engines do not serve its trained policy", "2 consecutive steps (through its step 3)",
                 "at its policy version 2"):
        assert part in msg, (part, msg)


def test_status_and_progress_carry_the_check():
    p = Progress(5, "Adapter")
    p.update(step=2, servingCheck=ServingCheck(0.25, 3).observe(2, 1, OK, 1e-6))
    snap = p.snapshot()
    assert snap["servingCheck"]["logpGapMax"] == OK and snap["servingCheck"]["version"] == 1
    assert progress_of(snap)["servingCheck"]["threshold"] == 0.25  # status.progress keeps it


def conds_for(gap, threshold=0.25, **kw):
    snap = {"step": 4, "totalSteps": 9, "servingCheck": {"logpGapMax": gap, "logpGapMean": gap / 10, "version": 3,
                                                         "step": 4, "threshold": threshold, "badSteps": 1}}
    s = LoRATrainingJob.model_validate(valid_job("p", **kw)).spec
    return [{"type": str(c.type), "status": c.status, "reason": str(c.reason), "message": c.message}
            for c in progress_conditions(progress_of(snap), s)]


def served(conds):
    return next(c for c in conds if c["type"] == "PolicyServed")


def test_policy_served_true_below_false_above_with_a_warning_event():
    good, bad = conds_for(OK), conds_for(BAD)
    assert served(good)["status"] == "True" and served(good)["reason"] == "PolicyServed"
    assert served(bad)["status"] == "False" and served(bad)["reason"] == "PolicyNotServed"
    assert "0.9" in served(bad)["message"] and "policy version 3" in served(bad)["message"]
    assert "sync.servedLogpGapMax 0.25" in served(bad)["message"]
    news = transitions(good, bad)
    assert [(t.type, t.reason) for t in news if t.reason == "PolicyNotServed"] == [("Warning", "PolicyNotServed")]
    back = transitions(bad, good)
    assert [(t.type, t.reason) for t in back if t.reason == "PolicyServed"] == [("Normal", "PolicyServed")]


def test_no_measured_gap_sets_no_condition():
    s = LoRATrainingJob.model_validate(valid_job("p")).spec
    assert all(str(c.type) != "PolicyServed" for c in progress_conditions({"step": 1, "totalSteps": 3}, s))
