"""One level-based reconcile for a LoRATrainingJob, whatever woke it up (create, resume after a
restart, a spec update, or a change of its RayJob).

It reads the job afresh, creates whatever child is missing (deterministic names: a second
attempt finds the first one's objects), nudges the RayJob's lifecycle fields to the spec, derives
the status from the RayJob's and writes it, through /status, only when it changed. Transient API
trouble raises kopf.TemporaryError; nothing here sleeps.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import kopf

from kora_operator.api.job import LoRATrainingJob, RuntimeKind
from kora_operator.builders.children import build_children
from kora_operator.builders.names import ray_job_name
from kora_operator.builders.rayjob import mutable_spec
from kora_operator.builders.secret import new_token
from kora_operator.conditions import Cond, get_condition, set_condition, transitions
from kora_operator.kube import ApiException, Kube, now_rfc3339
from kora_operator.metrics import CHILDREN_CREATED, observe_reconcile
from kora_operator.phase import TERMINAL, next_status, observe
from kora_operator.reasons import ConditionType, EventType, Reason
from kora_operator.validation import validate_job

log = logging.getLogger("kora.reconcile")
RETRY_DELAY = 5.0  # seconds kopf waits before retrying after transient API trouble

# Handlers for one job (its own events, its RayJob's) may run in parallel threads; one at a time
# per job keeps the read-decide-write of the status from racing itself.
_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def _lock(ns: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks[(ns, name)]


def forget(ns: str, name: str) -> None:
    with _locks_guard:
        _locks.pop((ns, name), None)


def reconcile(kube: Kube, ns: str, name: str, trigger: str) -> None:
    with observe_reconcile(trigger), _lock(ns, name):
        body = kube.get_job(ns, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # gone or going: the garbage collector takes the children
        _reconcile(kube, body)


def _doc(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(body["metadata"]),
            "spec": body.get("spec") or {}}


def _reconcile(kube: Kube, body: dict[str, Any]) -> None:
    meta, current = body["metadata"], body.get("status") or {}
    name, generation = meta["name"], meta.get("generation")
    if current.get("phase") in TERMINAL:
        return  # finished jobs are history; KubeRay's TTL cleans the cluster up
    now = now_rfc3339()
    job, problems = validate_job(_doc(body))
    errors = [p for p in problems if p.severity == "error"]
    if job is None or errors:
        message = "; ".join(f"{p.field}: {p.message}" for p in errors) or "invalid spec"
        _fail(kube, body, Cond(ConditionType.VALIDATED, "False", Reason.VALIDATION_FAILED, message), now)
        return
    status: dict[str, Any] = dict(current)
    first_time = get_condition(current.get("conditions") or [], ConditionType.VALIDATED) is None
    if first_time and job.spec.lora.sync_mode is None:
        kube.event(body, EventType.WARNING, Reason.SYNC_MODE_DEFAULTED,
                   "lora.syncMode is not set: using Merge (set it to Merge, Adapter or EngineMerge to silence this)")
    status["syncMode"] = str(job.spec.lora.effective_sync_mode)
    status["conditions"] = set_condition(
        current.get("conditions") or [], Cond(ConditionType.VALIDATED, "True", Reason.VALIDATED,
                                             "the spec passed every rule"), generation, now)
    if job.spec.runtime.kind is not RuntimeKind.KUBERAY:
        _fail(kube, body, Cond(ConditionType.FAILED, "True", Reason.RUNTIME_NOT_SUPPORTED,
              "runtime.kind Ray is not reconciled by this operator version yet: use runtime.kind KubeRay, "
              "or run `python -m kora_trainer.train --config` against the Ray cluster yourself"), now, status)
        return
    ray = _ensure_children(kube, body, job)
    ray_name = ray_job_name(name)
    ray_status = ray.get("status") if ray else None
    new = next_status(status, observe(ray_name, ray_status, job.spec.suspend), ray_status,
                      ray_name=ray_name, generation=generation, now=now)
    _write(kube, body, current, new)


def _ensure_children(kube: Kube, body: dict[str, Any], job: LoRATrainingJob) -> dict[str, Any] | None:
    """Create what is missing; return the RayJob as it stands.

    The Secret is never read: create answers 409 when it exists, which is all we need to know, and
    so the operator's account may create Secrets but needs no right to read any.
    """
    ray: dict[str, Any] | None = None
    for child in build_children(job, token=new_token()):
        kind = child["kind"]
        existing = None if kind == "Secret" else kube.get_child(child)
        if existing is None:
            try:
                created = kube.create_child(child)
            except ApiException as e:
                kube.event(body, EventType.WARNING, f"FailedToCreate{kind}",
                           f"creating {kind} {child['metadata']['name']} failed: {e.status} {e.reason}")
                raise kopf.TemporaryError(f"creating {kind}: {e.status} {e.reason}", delay=RETRY_DELAY) from e
            if created is not None:  # None: it was there already (a Secret, or a race)
                CHILDREN_CREATED.labels(kind).inc()
                kube.event(body, EventType.NORMAL, f"Created{kind}", f"created {kind} {child['metadata']['name']}")
                existing = created
            elif kind != "Secret":
                existing = kube.get_child(child)
        if kind == "RayJob":
            ray = existing
            if ray is not None:
                _align_ray_job(kube, body, job, ray)
    return ray


def _align_ray_job(kube: Kube, body: dict[str, Any], job: LoRATrainingJob, ray: dict[str, Any]) -> None:
    want = mutable_spec(job)
    if job.spec.queue_name and not job.spec.suspend:
        # Kueue admits a queued RayJob by unsuspending it itself; resuming it here would jump the queue
        want.pop("suspend")
    have = ray.get("spec") or {}
    patch = {k: v for k, v in want.items() if have.get(k) != v}
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


def _fail(kube: Kube, body: dict[str, Any], cond: Cond, now: str, status: dict[str, Any] | None = None) -> None:
    current = body.get("status") or {}
    status = dict(status if status is not None else current)
    generation = body["metadata"].get("generation")
    conditions = set_condition(status.get("conditions") or [], cond, generation, now)
    if cond.type is not ConditionType.FAILED:
        conditions = set_condition(conditions, Cond(ConditionType.FAILED, "True", cond.reason, cond.message),
                                   generation, now)
    status.update(phase="Failed", conditions=conditions, observedGeneration=generation, completionTime=now)
    _write(kube, body, current, status)


def _write(kube: Kube, body: dict[str, Any], current: Mapping[str, Any], new: dict[str, Any]) -> None:
    if new == current:
        return
    meta = body["metadata"]
    kube.patch_job_status(meta["namespace"], meta["name"], new)
    for t in transitions(current.get("conditions") or [], new.get("conditions") or []):
        kube.event(body, t.type, t.reason, t.message)
    if new.get("phase") != current.get("phase"):
        log.info("%s/%s: phase %s -> %s", meta["namespace"], meta["name"], current.get("phase"), new.get("phase"))
