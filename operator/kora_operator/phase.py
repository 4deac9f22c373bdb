"""From the RayJob's status to the LoRATrainingJob's: phase, conditions and observed fields.

KubeRay reports two things (apis/ray/v1/rayjob_types.go, v1.5.0): jobDeploymentStatus, the
life of the Ray cluster and the submission (Initializing, Running, Complete, Failed,
ValidationFailed, Suspending, Suspended, Retrying, Waiting), and jobStatus, the Ray job itself
(PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED). This module is pure: the RayJob status and the
job's own status go in, the next status comes out; the handler decides whether to write it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kora_operator.api.status import Phase
from kora_operator.conditions import Cond, set_conditions
from kora_operator.reasons import KUBERAY_FAILURE_REASONS, ConditionType, Reason

TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)
T, F = "True", "False"


@dataclass(frozen=True)
class Observation:
    phase: Phase
    conditions: list[Cond] = field(default_factory=list)
    terminal_time: str | None = None  # when the trainer ended, if it did


def _failed(reason: Reason, message: str) -> Observation:
    return Observation(Phase.FAILED, [
        Cond(ConditionType.TRAINING, F, reason, message),
        Cond(ConditionType.CLUSTER_READY, F, Reason.CLUSTER_SHUT_DOWN, "the trainer ended; KubeRay shuts the "
             "Ray cluster down after spec.ttlSecondsAfterFinished"),
        Cond(ConditionType.FAILED, T, reason, message),
    ])


def observe(ray_name: str, ray: Mapping[str, Any] | None, suspend: bool) -> Observation:
    """What the RayJob named `ray_name` (status `ray`; None before it exists) says about the job."""
    ray = ray or {}
    deploy = str(ray.get("jobDeploymentStatus") or "")
    job = str(ray.get("jobStatus") or "")
    cluster = ray.get("rayClusterName") or "the Ray cluster"
    kuberay_msg = str(ray.get("message") or "")
    end = ray.get("endTime")
    if deploy == "Complete":
        if job == "SUCCEEDED":
            msg = f"the trainer finished successfully (RayJob {ray_name})"
            return Observation(Phase.SUCCEEDED, [
                Cond(ConditionType.TRAINING, F, Reason.SUCCEEDED, msg),
                Cond(ConditionType.CLUSTER_READY, F, Reason.CLUSTER_SHUT_DOWN, "the trainer ended; KubeRay shuts "
                     "the Ray cluster down after spec.ttlSecondsAfterFinished"),
                Cond(ConditionType.COMPLETE, T, Reason.SUCCEEDED, msg),
            ], terminal_time=end)
        reason = Reason.TRAINER_STOPPED if job == "STOPPED" else Reason.TRAINER_FAILED
        obs = _failed(reason, kuberay_msg or f"Ray job {job or 'ended'}: see `kubectl logs` of the "
                      f"RayJob {ray_name} submitter and the Ray head")
        return Observation(obs.phase, obs.conditions, terminal_time=end)
    if deploy in ("Failed", "ValidationFailed"):
        reason = KUBERAY_FAILURE_REASONS.get(str(ray.get("reason") or ""), Reason.RAY_JOB_FAILED)
        if deploy == "ValidationFailed":
            reason = Reason.RAY_JOB_REJECTED
        obs = _failed(reason, kuberay_msg or f"KubeRay marked RayJob {ray_name} {deploy}")
        return Observation(obs.phase, obs.conditions, terminal_time=end)
    if suspend:  # shown at once; KubeRay deletes the cluster in its own time
        return Observation(Phase.SUSPENDED, [
            Cond(ConditionType.CLUSTER_READY, F, Reason.SUSPENDED, "spec.suspend is true: the Ray cluster is "
                 "deleted; set it to false to resume from the last checkpoint"),
            Cond(ConditionType.TRAINING, F, Reason.SUSPENDED, "the job is suspended"),
        ])
    if deploy in ("Suspending", "Suspended"):
        return Observation(Phase.PROVISIONING, [
            Cond(ConditionType.CLUSTER_READY, F, Reason.RESUMING, f"resuming: KubeRay is recreating {cluster}"),
        ])
    if deploy in ("Initializing", "Waiting"):
        return Observation(Phase.PROVISIONING, [
            Cond(ConditionType.CLUSTER_READY, F, Reason.CLUSTER_PROVISIONING,
                 f"KubeRay is creating {cluster} for RayJob {ray_name}"),
        ])
    if deploy == "Retrying":
        failed = int(ray.get("failed") or 0)
        return Observation(Phase.PROVISIONING, [
            Cond(ConditionType.CLUSTER_READY, F, Reason.RETRYING,
                 f"attempt {failed} failed; KubeRay is starting a new Ray cluster (resuming from the last "
                 f"checkpoint){': ' + kuberay_msg if kuberay_msg else ''}"),
            Cond(ConditionType.TRAINING, F, Reason.RETRYING, f"attempt {failed} failed; retrying"),
        ])
    if deploy == "Running":
        ready = Cond(ConditionType.CLUSTER_READY, T, Reason.CLUSTER_READY, f"{cluster} is ready")
        if job == "RUNNING":
            return Observation(Phase.RUNNING, [
                ready, Cond(ConditionType.TRAINING, T, Reason.TRAINER_RUNNING, f"the trainer runs on {cluster}"),
            ])
        return Observation(Phase.PROVISIONING, [
            ready, Cond(ConditionType.TRAINING, F, Reason.TRAINER_PENDING,
                        f"the trainer is submitted to {cluster} and waits to start"),
        ])
    return Observation(Phase.PENDING, [
        Cond(ConditionType.CLUSTER_READY, F, Reason.RAY_JOB_PENDING,
             f"RayJob {ray_name} is created; waiting for KubeRay to pick it up"),
    ])


def _restarts(ray: Mapping[str, Any], phase: Phase) -> int:
    """Retries KubeRay made: each failed attempt but a final one counts as a restart."""
    failed = int(ray.get("failed") or 0)
    return max(0, failed - 1) if phase is Phase.FAILED else failed


def next_status(
    current: Mapping[str, Any],
    obs: Observation,
    ray: Mapping[str, Any] | None,
    *,
    ray_name: str | None,
    generation: int | None,
    now: str,
    restarts: int | None = None,
) -> dict[str, Any]:
    """The status to hold after `obs`. A finished job stays finished: once Succeeded or Failed, a
    later RayJob change (its cluster torn down, the RayJob deleted by hand) no longer moves it.

    `ray` is the RayJob's status (runtime KubeRay) or the same keys made up from the Ray job
    (runtime Ray); `restarts`, when given, replaces the count derived from KubeRay's `failed`."""
    status = dict(current)
    if status.get("phase") in TERMINAL:
        status["observedGeneration"] = generation
        return status
    ray = ray or {}
    status["phase"] = str(obs.phase)
    status["conditions"] = set_conditions(current.get("conditions") or [], obs.conditions, generation, now)
    status["observedGeneration"] = generation
    status["rayJobName"] = ray_name
    for ours, theirs in (("rayClusterName", "rayClusterName"), ("dashboardURL", "dashboardURL"),
                         ("startTime", "startTime")):
        if ray.get(theirs):
            status[ours] = ray[theirs]
    if obs.phase in TERMINAL:
        status["completionTime"] = obs.terminal_time or now
    if restarts is None:
        restarts = _restarts(ray, obs.phase)
    if restarts or "restarts" in status:
        status["restarts"] = restarts
    return {k: v for k, v in status.items() if v is not None}
