"""Conditions (metav1 shape, transition times), event transitions, and phase derivation."""

from __future__ import annotations

import pytest

from kora_operator.api.job import LoRATrainingJob
from kora_operator.conditions import MAX_MESSAGE, Cond, get_condition, set_condition, transitions, truncate
from kora_operator.reasons import ConditionType, EventType, Reason
from kora_operator.runtimes.base import next_status
from kora_operator.runtimes.kuberay import align_ray_job, observe
from specs import valid_job

T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "2026-01-01T00:02:00Z"


def test_set_condition_adds_then_keeps_transition_time_until_status_flips():
    c = set_condition([], Cond(ConditionType.CLUSTER_READY, "False", Reason.CLUSTER_PROVISIONING, "wait"), 1, T0)
    assert c == [{"type": "ClusterReady", "status": "False", "observedGeneration": 1,
                  "lastTransitionTime": T0, "reason": "ClusterProvisioning", "message": "wait"}]
    # same status, new reason/message/generation: an update, not a transition
    c = set_condition(c, Cond(ConditionType.CLUSTER_READY, "False", Reason.RETRYING, "again"), 2, T1)
    assert c[0]["lastTransitionTime"] == T0 and c[0]["reason"] == "Retrying" and c[0]["observedGeneration"] == 2
    c = set_condition(c, Cond(ConditionType.CLUSTER_READY, "True", Reason.CLUSTER_READY, "up"), 2, T2)
    assert c[0]["lastTransitionTime"] == T2 and c[0]["status"] == "True"


def test_set_condition_leaves_others_and_the_input_alone():
    a = set_condition([], Cond(ConditionType.VALIDATED, "True", Reason.VALIDATED), 1, T0)
    b = set_condition(a, Cond(ConditionType.TRAINING, "True", Reason.TRAINER_RUNNING), 1, T1)
    assert [c["type"] for c in b] == ["Validated", "Training"] and len(a) == 1
    assert get_condition(b, "Validated") == a[0]


def test_truncate_caps_bytes():
    assert truncate("x" * 5000).endswith("...") and len(truncate("é" * 5000).encode()) <= MAX_MESSAGE
    assert truncate("short") == "short"


def test_transitions_name_changes_and_warn_on_failure():
    old = set_condition([], Cond(ConditionType.TRAINING, "True", Reason.TRAINER_RUNNING, "r"), 1, T0)
    new = set_condition(old, Cond(ConditionType.FAILED, "True", Reason.TRAINER_FAILED, "boom"), 1, T1)
    (t,) = transitions(old, new)
    assert (t.type, t.reason, t.message) == (EventType.WARNING, "TrainerFailed", "boom")
    assert transitions(new, new) == []
    bad = set_condition([], Cond(ConditionType.VALIDATED, "False", Reason.VALIDATION_FAILED, "fix x"), 1, T0)
    assert transitions([], bad)[0].type is EventType.WARNING


RAY = "demo-ray"


@pytest.mark.parametrize(("deploy", "job", "suspend", "phase", "reasons"), [
    (None, None, False, "Pending", {"ClusterReady": "RayJobPending"}),
    ("", "", False, "Pending", {"ClusterReady": "RayJobPending"}),
    ("Initializing", "", False, "Provisioning", {"ClusterReady": "ClusterProvisioning"}),
    ("Running", "PENDING", False, "Provisioning", {"ClusterReady": "ClusterReady", "Training": "TrainerPending"}),
    ("Running", "RUNNING", False, "Running", {"ClusterReady": "ClusterReady", "Training": "TrainerRunning"}),
    # the Ray job ended, KubeRay not yet Complete (its submitter pod still ending): no step back to Provisioning
    ("Running", "SUCCEEDED", False, "Running", {"ClusterReady": "ClusterReady", "Training": "TrainerRunning"}),
    ("Running", "FAILED", False, "Running", {"ClusterReady": "ClusterReady", "Training": "TrainerRunning"}),
    ("Complete", "SUCCEEDED", False, "Succeeded", {"Complete": "Succeeded", "Training": "Succeeded"}),
    ("Complete", "FAILED", False, "Failed", {"Failed": "TrainerFailed"}),
    ("Complete", "STOPPED", False, "Failed", {"Failed": "TrainerStopped"}),
    ("Retrying", "FAILED", False, "Provisioning", {"ClusterReady": "Retrying"}),
    ("Suspended", "", True, "Suspended", {"ClusterReady": "Suspended"}),
    ("Running", "RUNNING", True, "Suspended", {"Training": "Suspended"}),
    ("Suspended", "", False, "Provisioning", {"ClusterReady": "Resuming"}),
    ("ValidationFailed", "", False, "Failed", {"Failed": "RayJobRejected"}),
])
def test_observe_maps_kuberay_states(deploy, job, suspend, phase, reasons):
    ray = None if deploy is None else {"jobDeploymentStatus": deploy, "jobStatus": job}
    obs = observe(RAY, ray, suspend)
    assert obs.phase == phase
    got = {c.type: c.reason for c in obs.conditions}
    assert {k: got[k] for k in reasons} == reasons


@pytest.mark.parametrize(("kuberay", "ours"), [
    ("AppFailed", "TrainerFailed"), ("DeadlineExceeded", "DeadlineExceeded"),
    ("SubmissionFailed", "SubmissionFailed"), ("SomethingNew", "RayJobFailed"),
])
def test_failed_rayjob_reasons_are_mapped_and_message_kept(kuberay, ours):
    obs = observe(RAY, {"jobDeploymentStatus": "Failed", "reason": kuberay, "message": "why"}, False)
    failed = next(c for c in obs.conditions if c.type == "Failed")
    assert (obs.phase, failed.reason, failed.message) == ("Failed", ours, "why")


def test_next_status_copies_rayjob_fields_and_stays_terminal():
    ray = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "rayClusterName": "demo-ray-abcde",
           "dashboardURL": "demo-ray-abcde-head-svc.ns.svc.cluster.local:8265", "startTime": T0}
    running = next_status({"syncMode": "Merge"}, observe(RAY, ray, False), ray, ray_name=RAY, generation=3, now=T1)
    assert running["phase"] == "Running" and running["syncMode"] == "Merge"
    assert running["rayJobName"] == RAY and running["rayClusterName"] == "demo-ray-abcde"
    assert running["dashboardURL"].endswith(":8265") and running["startTime"] == T0
    assert running["observedGeneration"] == 3 and "completionTime" not in running
    done = {**ray, "jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "endTime": T2}
    ok = next_status(running, observe(RAY, done, False), done, ray_name=RAY, generation=3, now=T2)
    assert ok["phase"] == "Succeeded" and ok["completionTime"] == T2
    assert get_condition(ok["conditions"], "Training")["lastTransitionTime"] == T2
    # the RayJob going away later does not un-finish the job
    again = next_status(ok, observe(RAY, None, False), None, ray_name=RAY, generation=3, now="2030-01-01T00:00:00Z")
    assert again == ok


def test_restarts_count_kuberay_retries():
    ray = {"jobDeploymentStatus": "Retrying", "failed": 2}
    assert next_status({}, observe(RAY, ray, False), ray, ray_name=RAY, generation=1, now=T0)["restarts"] == 2
    ray = {"jobDeploymentStatus": "Failed", "reason": "AppFailed", "failed": 3}
    assert next_status({}, observe(RAY, ray, False), ray, ray_name=RAY, generation=1, now=T0)["restarts"] == 2


def test_next_status_is_stable_when_nothing_changed():
    ray = {"jobDeploymentStatus": "Initializing"}
    a = next_status({}, observe(RAY, ray, False), ray, ray_name=RAY, generation=1, now=T0)
    b = next_status(a, observe(RAY, ray, False), ray, ray_name=RAY, generation=1, now=T1)
    assert a == b


class _RecordingKube:
    def __init__(self) -> None:
        self.patches: list[dict] = []
        self.events: list[tuple] = []

    def patch_ray_job(self, ns: str, name: str, patch: dict) -> None:
        self.patches.append(patch)

    def event(self, body, kind, reason, message) -> None:
        self.events.append((kind, reason, message))


def test_a_rayjob_kuberay_wrote_back_without_its_zero_fields_is_not_patched():
    """KubeRay updates the RayJob from its Go struct (omitempty): suspend false and a 0 TTL come back absent. The real
    node showed `set suspend=False on RayJob` twice per job; absent is the zero value, nothing to align."""
    job = LoRATrainingJob.model_validate(valid_job("z", ttlSecondsAfterFinished=0, backoffLimit=2))
    kube = _RecordingKube()
    ray = {"metadata": {"namespace": "ns", "name": "z-ray"}, "spec": {"backoffLimit": 2}}
    align_ray_job(kube, {}, job, ray)  # type: ignore[arg-type]
    assert kube.patches == [] and kube.events == []
    ray["spec"] = {"backoffLimit": 1}  # a real difference is still patched
    align_ray_job(kube, {}, job, ray)  # type: ignore[arg-type]
    assert kube.patches == [{"spec": {"backoffLimit": 2}}]
