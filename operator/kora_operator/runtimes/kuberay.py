"""Runtime KubeRay: a RayJob per LoRATrainingJob, which KubeRay turns into a Ray cluster and a submission.

The RayJob is one of the job's children (builders/rayjob.py builds it, handlers/children.py makes it); here its
lifecycle fields are nudged to the spec (`align_ray_job`) and its status is mapped to the job's (`observe`).
KubeRay reports two things (apis/ray/v1/rayjob_types.go, v1.5.0): jobDeploymentStatus, the life of the Ray
cluster and the submission (Initializing, Running, Complete, Failed, ValidationFailed, Suspending, Suspended,
Retrying, Waiting), and jobStatus, the Ray job itself (PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED). `observe`
and `control_url` are pure; `KubeRay.advance` does the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import kopf

from kora_operator.api.job import LoRATrainingJob, RuntimeKind
from kora_operator.api.status import Phase
from kora_operator.builders.names import ray_job_name
from kora_operator.builders.rayjob import CONTROL_PORT, mutable_spec
from kora_operator.conditions import Cond
from kora_operator.kube import ApiException, Kube
from kora_operator.reasons import KUBERAY_FAILURE_REASONS, ConditionStatus, ConditionType, EventType, Reason
from kora_operator.runtimes.base import Advanced, Observation, Operator, Step, next_status
from kora_operator.settings import Settings

RETRY_DELAY = 5.0  # seconds kopf waits before retrying after transient API trouble
OMITTED_AS_ZERO = {"suspend": False, "ttlSecondsAfterFinished": 0}  # RayJob fields KubeRay drops when zero
SHUT_DOWN = "the trainer ended; KubeRay shuts the Ray cluster down after spec.ttlSecondsAfterFinished"


class KubeRay:
    kind = RuntimeKind.KUBERAY
    stops_on_delete = False  # the garbage collector takes the RayJob, and KubeRay the Ray cluster

    def advance(self, step: Step) -> Advanced:
        """The RayJob made or read (a poll leaves the children alone while it exists) and aligned to the spec;
        the next status from its status."""
        meta, kube = step.meta, step.ops.kube
        ray_name = ray_job_name(meta["name"])
        if step.poll:
            ray = kube.get_ray_job(meta["namespace"], ray_name) or self._ray_job(step, False, None)
        else:
            ray = self._ray_job(step, step.create_first, step.seen)
        ray_status = ray.get("status") if ray else None
        new = next_status(step.status, observe(ray_name, ray_status, step.job.spec.suspend), ray_status,
                          ray_name=ray_name, generation=meta.get("generation"), now=step.now)
        url = control_url(new, meta["namespace"]) if step.ops.settings.kuberay_progress else None
        return Advanced(new, url, ((ray or {}).get("metadata") or {}).get("resourceVersion"))

    def _ray_job(self, step: Step, create_first: bool, seen: dict[str, Any] | None) -> dict[str, Any] | None:
        """The RayJob as it stands, the children made if missing. Children all seen within the recheck time are
        not checked again: only the RayJob is read, or taken as `seen`; a deleted one makes them all again."""
        kube, meta = step.ops.kube, step.meta
        if step.children.known():
            have = seen or kube.get_ray_job(meta["namespace"], ray_job_name(meta["name"]))
            if have is not None:
                align_ray_job(kube, step.body, step.job, have)
                return have
            step.children.forget()  # gone since (its watch event is yet to come): make it again
        ray = step.children.create(create_first)
        if ray is not None:
            step.children.remember()
        return ray

    def trainer_url(self, ops: Operator, body: Mapping[str, Any]) -> str | None:
        if not ops.settings.kuberay_progress:
            return None
        return control_url(body.get("status") or {}, body["metadata"]["namespace"])

    def polls(self, phase: str | None, settings: Settings) -> bool:
        # KubeRay's own changes come as RayJob events: polled only for the trainer's progress while it runs
        return settings.kuberay_progress and phase == Phase.RUNNING


def align_ray_job(kube: Kube, body: dict[str, Any], job: LoRATrainingJob, ray: dict[str, Any]) -> None:
    """Patch the RayJob's lifecycle fields (builders/rayjob.mutable_spec) that differ from the spec."""
    want = mutable_spec(job)
    if job.spec.queue_name and not job.spec.suspend:
        # Kueue admits a queued RayJob by unsuspending it itself; resuming it here would jump the queue
        want.pop("suspend")
    have = ray.get("spec") or {}
    # KubeRay writes the RayJob back without its zero values (Go's omitempty): an absent suspend is false, an
    # absent TTL 0; read as a difference they made a patch and an UpdatedRayJob event per reconcile (real node)
    patch = {k: v for k, v in want.items() if have.get(k, OMITTED_AS_ZERO.get(k)) != v}
    if not patch:
        return
    meta = ray["metadata"]
    try:
        kube.patch_ray_job(meta["namespace"], meta["name"], {"spec": patch})
    except ApiException as e:
        kube.event(body, EventType.WARNING, Reason.FAILED_TO_UPDATE_RAY_JOB,
                   f"updating RayJob {meta['name']} {sorted(patch)} failed: {e.status} {e.reason}")
        raise kopf.TemporaryError(f"patching RayJob: {e.status} {e.reason}", delay=RETRY_DELAY) from e
    ray.setdefault("spec", {}).update(patch)
    changes = ", ".join(f"{k}={v}" for k, v in sorted(patch.items()))
    kube.event(body, EventType.NORMAL, Reason.UPDATED_RAY_JOB, f"set {changes} on RayJob {meta['name']}")


def control_url(status: Mapping[str, Any], namespace: str) -> str | None:
    """http://<head service>:8068 — the host KubeRay reports in the RayJob's dashboardURL
    (`<cluster>-head-svc.<ns>.svc.cluster.local:8265`), else the head service named after the Ray
    cluster; None before KubeRay has named the cluster. Reachable from inside the cluster (where
    the operator runs); the builder exposes the port on the head pod and its service."""
    dashboard = str(status.get("dashboardURL") or "")
    host = urlsplit(dashboard if "://" in dashboard else f"//{dashboard}").hostname if dashboard else None
    if not host and status.get("rayClusterName"):
        host = f"{status['rayClusterName']}-head-svc.{namespace}.svc"
    return f"http://{host}:{CONTROL_PORT}" if host else None


# -- the RayJob's status -> the job's (pure) ----------------------------------------------------------------------


def observe(ray_name: str, ray: Mapping[str, Any] | None, suspend: bool) -> Observation:
    """What the RayJob named `ray_name` (status `ray`; None before it exists) says about the job."""
    ray = ray or {}
    ended = _ended(ray_name, ray)
    if ended is not None:
        return ended
    if suspend:  # shown at once; KubeRay deletes the cluster in its own time
        return Observation(Phase.SUSPENDED, [
            Cond(ConditionType.CLUSTER_READY, ConditionStatus.FALSE, Reason.SUSPENDED, "spec.suspend is true: the "
                 "Ray cluster is deleted; set it to false to resume from the last checkpoint"),
            Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.SUSPENDED, "the job is suspended"),
        ])
    return _underway(ray_name, ray)


def _ended(ray_name: str, ray: Mapping[str, Any]) -> Observation | None:
    """The job's end, when KubeRay reports one (None: it has not ended)."""
    deploy, job = str(ray.get("jobDeploymentStatus") or ""), str(ray.get("jobStatus") or "")
    kuberay_msg, end = str(ray.get("message") or ""), ray.get("endTime")
    if deploy == "Complete" and job == "SUCCEEDED":
        msg = f"the trainer finished successfully (RayJob {ray_name})"
        return Observation(Phase.SUCCEEDED, [
            Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.SUCCEEDED, msg),
            Cond(ConditionType.CLUSTER_READY, ConditionStatus.FALSE, Reason.CLUSTER_SHUT_DOWN, SHUT_DOWN),
            Cond(ConditionType.COMPLETE, ConditionStatus.TRUE, Reason.SUCCEEDED, msg),
        ], terminal_time=end)
    if deploy == "Complete":
        reason = Reason.TRAINER_STOPPED if job == "STOPPED" else Reason.TRAINER_FAILED
        return _failed(reason, kuberay_msg or f"Ray job {job or 'ended'}: see `kubectl logs` of the "
                       f"RayJob {ray_name} submitter and the Ray head", end)
    if deploy in ("Failed", "ValidationFailed"):
        reason = KUBERAY_FAILURE_REASONS.get(str(ray.get("reason") or ""), Reason.RAY_JOB_FAILED)
        if deploy == "ValidationFailed":
            reason = Reason.RAY_JOB_REJECTED
        return _failed(reason, kuberay_msg or f"KubeRay marked RayJob {ray_name} {deploy}", end)
    return None


def _failed(reason: Reason, message: str, end: str | None) -> Observation:
    return Observation(Phase.FAILED, [
        Cond(ConditionType.TRAINING, ConditionStatus.FALSE, reason, message),
        Cond(ConditionType.CLUSTER_READY, ConditionStatus.FALSE, Reason.CLUSTER_SHUT_DOWN, SHUT_DOWN),
        Cond(ConditionType.FAILED, ConditionStatus.TRUE, reason, message),
    ], terminal_time=end)


def _underway(ray_name: str, ray: Mapping[str, Any]) -> Observation:
    """A job not ended and not suspended: its cluster being made, retried or resumed, or its trainer running."""
    deploy = str(ray.get("jobDeploymentStatus") or "")
    cluster = ray.get("rayClusterName") or "the Ray cluster"
    not_ready = ConditionType.CLUSTER_READY, ConditionStatus.FALSE
    if deploy in ("Suspending", "Suspended"):
        return Observation(Phase.PROVISIONING, [
            Cond(*not_ready, Reason.RESUMING, f"resuming: KubeRay is recreating {cluster}"),
        ])
    if deploy in ("Initializing", "Waiting"):
        return Observation(Phase.PROVISIONING, [
            Cond(*not_ready, Reason.CLUSTER_PROVISIONING, f"KubeRay is creating {cluster} for RayJob {ray_name}"),
        ])
    if deploy == "Retrying":
        failed, kuberay_msg = int(ray.get("failed") or 0), str(ray.get("message") or "")
        return Observation(Phase.PROVISIONING, [
            Cond(*not_ready, Reason.RETRYING,
                 f"attempt {failed} failed; KubeRay is starting a new Ray cluster (resuming from the last "
                 f"checkpoint){': ' + kuberay_msg if kuberay_msg else ''}"),
            Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.RETRYING, f"attempt {failed} failed; retrying"),
        ])
    if deploy == "Running":
        return _running(ray, cluster)
    return Observation(Phase.PENDING, [
        Cond(*not_ready, Reason.RAY_JOB_PENDING, f"RayJob {ray_name} is created; waiting for KubeRay to pick it up"),
    ])


def _running(ray: Mapping[str, Any], cluster: str) -> Observation:
    ready = Cond(ConditionType.CLUSTER_READY, ConditionStatus.TRUE, Reason.CLUSTER_READY, f"{cluster} is ready")
    job = str(ray.get("jobStatus") or "")
    if job == "RUNNING":
        return Observation(Phase.RUNNING, [
            ready, Cond(ConditionType.TRAINING, ConditionStatus.TRUE, Reason.TRAINER_RUNNING,
                        f"the trainer runs on {cluster}"),
        ])
    if job in ("SUCCEEDED", "FAILED", "STOPPED"):
        # the Ray job ended and KubeRay has yet to say Complete (it waits for its submitter pod to end): still
        # Running, not back to "waits to start" (the real node showed Running -> Provisioning -> Succeeded)
        return Observation(Phase.RUNNING, [
            ready, Cond(ConditionType.TRAINING, ConditionStatus.TRUE, Reason.TRAINER_RUNNING,
                        f"the trainer ended ({job}) on {cluster}; KubeRay is completing the RayJob"),
        ])
    return Observation(Phase.PROVISIONING, [
        ready, Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.TRAINER_PENDING,
                    f"the trainer is submitted to {cluster} and waits to start"),
    ])
