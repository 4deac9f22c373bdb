"""A LoRAAdapter's status and conditions from the trainer's state of it (kora_operator.adapter_runs, pure), and
the Events their transitions post."""

from __future__ import annotations

import pytest

from kora_operator.adapter_runs import MIRRORED, mirrored, run_conditions
from kora_operator.conditions import Cond, set_conditions, transitions
from kora_operator.reasons import ConditionType, Reason
from kora_trainer.config.adapter_runs import AdapterPhase, AdapterRunState
from kora_trainer.config.status import SyncProgress

NOW = "2026-12-01T10:00:00Z"


def run(phase: AdapterPhase, **over: object) -> AdapterRunState:
    fields: dict[str, object] = {"name": "a", "phase": phase, "slot": 1, "step": 5, "num_steps": 10, "version": 5,
                                 "reward_mean": 0.5, "message": ""}
    fields.update(over)
    return AdapterRunState.model_validate(fields)


def conds(r: AdapterRunState, max_staleness: int = 0) -> dict[str, tuple[str, str, str]]:
    return {str(c.type): (c.status, str(c.reason), c.message) for c in run_conditions(r, "svc", max_staleness)}


def test_mirrored_fields_are_the_trainers_and_a_freed_slot_is_none():
    got = mirrored(run(AdapterPhase.SUCCEEDED, slot=None, export_path="/x"))
    assert tuple(got) == MIRRORED
    assert got["phase"] == "Succeeded" and got["slot"] is None and got["exportPath"] == "/x" and got["numSteps"] == 10
    assert got["lastSync"] is None and got["rewardMean"] == 0.5


@pytest.mark.parametrize(("phase", "training", "reason"), [
    (AdapterPhase.PENDING, "False", Reason.WAITING_TO_LOAD),
    (AdapterPhase.TRAINING, "True", Reason.ADAPTER_TRAINING),
    (AdapterPhase.RETIRING, "False", Reason.RETIRING),
    (AdapterPhase.SUCCEEDED, "False", Reason.SUCCEEDED),
    (AdapterPhase.RETIRED, "False", Reason.RETIRED),
    (AdapterPhase.FAILED, "False", Reason.ADAPTER_FAILED),
])
def test_each_phase_says_registered_and_how_training_stands(phase, training, reason):
    got = conds(run(phase))
    assert got["Registered"][:2] == ("True", "Registered") and "svc" in got["Registered"][2]
    assert got["Training"][:2] == (training, reason)
    assert ("Complete" in got) == (phase is AdapterPhase.SUCCEEDED)
    assert ("Failed" in got) == (phase is AdapterPhase.FAILED)
    assert "WeightsSynced" not in got  # never pushed yet


def test_training_counts_steps_and_complete_names_the_export():
    assert conds(run(AdapterPhase.TRAINING))["Training"][2] == "step 5 of 10"
    assert conds(run(AdapterPhase.TRAINING, num_steps=None))["Training"][2] == "step 5"
    done = conds(run(AdapterPhase.SUCCEEDED, step=10, export_path="/ckpt/adapters/a/export"))["Complete"]
    assert done == ("True", "Succeeded", "trained 10 steps; exported to /ckpt/adapters/a/export")
    failed = conds(run(AdapterPhase.FAILED, message="CUDA out of memory"))["Failed"]
    assert failed == ("True", "AdapterFailed", "CUDA out of memory")


def test_weights_synced_turns_false_when_the_engines_fall_behind_the_jobs_staleness():
    sync = SyncProgress(adapter_version=3)
    fresh = conds(run(AdapterPhase.TRAINING, step=4, version=3, last_sync=sync), max_staleness=1)
    assert fresh["WeightsSynced"][:2] == ("True", "WeightsSynced")
    stale = conds(run(AdapterPhase.TRAINING, step=5, version=3, last_sync=sync), max_staleness=1)
    assert stale["WeightsSynced"][:2] == ("False", "EnginesBehind") and "2 steps behind" in stale["WeightsSynced"][2]


def test_transitions_post_one_event_each_and_warn_of_failures_and_a_full_job():
    registered = set_conditions([], run_conditions(run(AdapterPhase.PENDING), "svc", 0), 1, NOW)
    events = transitions([], registered)
    assert [(t.type, t.reason) for t in events] == [("Normal", "Registered"), ("Normal", "WaitingToLoad")]
    assert transitions(registered, registered) == []
    failed = set_conditions(registered, run_conditions(run(AdapterPhase.FAILED, message="boom"), "svc", 0), 1, NOW)
    assert ("Warning", "AdapterFailed") in [(t.type, t.reason) for t in transitions(registered, failed)]
    full = set_conditions([], [Cond(ConditionType.REGISTERED, "False", Reason.NO_FREE_SLOT, "no free slot")], 1, NOW)
    assert [(t.type, t.reason) for t in transitions([], full)] == [("Warning", "NoFreeSlot")]
