"""One level-based reconcile for a LoRATrainingJob, whatever woke it up (create, resume after a
restart, a spec update, a change of its RayJob, or the poll loop).

It reads the job afresh, chooses its runtime once (runtimes.runtime_of: KubeRay or an existing Ray cluster) and
hands it the job (runtimes.base.Step): the runtime creates whatever child is missing (deterministic names: a second
attempt finds the first one's objects; handlers/children.py), nudges the RayJob's lifecycle fields to the spec
(KubeRay) or the Ray job's submission to its state (Ray), and derives the next status. Then the trainer's progress
is read while it runs, and the status is written, through /status, only when it changed: handed to the status
writer (statuses.py: behind the reconciles, coalesced per job), and derived from the status as this operator last
decided it (the API's, with its writes still pending applied), so that a write not made yet neither repeats a
transition's Event nor redoes work. Last, the job's LoRAAdapters are synced to what it showed
(handlers/adapter_sync.py). Transient API trouble raises kopf.TemporaryError; nothing here sleeps.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from kora_operator.api.job import LoRATrainingJob
from kora_operator.api.status import TERMINAL, Phase
from kora_operator.conditions import Cond, get_condition, set_condition, set_conditions, transitions
from kora_operator.handlers.adapter_sync import sync_job_adapters
from kora_operator.handlers.children import JobChildren
from kora_operator.handlers.context import Context, JobView, adapter_state
from kora_operator.handlers.memory import KnownChildren
from kora_operator.kube import now_rfc3339
from kora_operator.metrics import observe_reconcile
from kora_operator.progress import ProgressUnavailable, fetch, progress_conditions, read_status, status_progress
from kora_operator.reasons import ConditionStatus, ConditionType, EventType, Reason
from kora_operator.runtimes import RAY, Runtime, runtime_of
from kora_operator.runtimes.base import Advanced, Step
from kora_operator.runtimes.rayjobs import JobInfo
from kora_operator.settings import Settings
from kora_operator.validation import validate_job
from kora_trainer.config.adapter_runs import AdapterRunsState
from kora_trainer.config.status import TrainerPhase

log = logging.getLogger("kora.reconcile")

# Handlers for one job (its own events, its RayJob's) may run in parallel threads; one at a time
# per job keeps the read-decide-write of the status from racing itself.
_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def _lock(ns: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks[(ns, name)]


def forget(ctx: Context | None, ns: str, name: str, uid: str | None = None) -> None:
    with _locks_guard:
        _locks.pop((ns, name), None)
    if ctx is not None:
        if ctx.statuses is not None and uid:
            ctx.statuses.forget(ns, name, uid)
        if ctx.children is not None and uid:
            ctx.children.forget(uid)
        ctx.progress_errors.pop((ns, name), None)
        if ctx.poller is not None:
            ctx.poller.unwatch(ns, name)


def reconcile(ctx: Context, ns: str, name: str, trigger: str, body: dict[str, Any] | None = None,
              ray: dict[str, Any] | None = None) -> JobView | None:
    """Reconcile one job, then its adapters (they see the job and its trainer as this reconcile left them);
    return how the job stands now (None: gone or being deleted, or nothing to do).

    `body`: the job as kopf's create handler was handed it, just listed or watched. A job being created has had
    no reconcile that could have changed it since (none finished: kopf calls create until one does), so it is
    not read again, and its children are created without asking first whether they exist. `ray`: its RayJob as
    a watch event just showed it, used instead of reading it when the children are known to exist; nothing is
    done when the job's status was derived from this very version of it (the echo of the create that made it:
    in a burst its event waits here, on the lock, while that reconcile finishes)."""
    view = _reconcile_job(ctx, ns, name, trigger, body, ray)
    if view is not None:
        sync_job_adapters(ctx, ns, name, view, poll=trigger == "poll")
    return view


def _reconcile_job(ctx: Context, ns: str, name: str, trigger: str, body: dict[str, Any] | None,
                   ray: dict[str, Any] | None) -> JobView | None:
    with observe_reconcile(trigger), _lock(ns, name):
        if ray is not None and ctx.children is not None and _status_reflects(ctx.children, ray):
            return None
        body = ctx.decided(body if body is not None else ctx.kube.get_job(ns, name))
        if body is None or body["metadata"].get("deletionTimestamp"):
            if ctx.poller is not None:
                ctx.poller.unwatch(ns, name)
            return None  # gone or going: the garbage collector takes the children (a finalizer stops a Ray job)
        runtime = runtime_of(body.get("spec") or {})  # chosen once: what follows asks it, never the kind
        view = _reconcile(ctx, runtime, body, poll=trigger == "poll", create_first=trigger == "create", ray=ray)
        if ctx.poller is not None:
            if _needs_polling(runtime, view.status, ctx.settings):
                ctx.poller.watch(ns, name)
            else:
                ctx.poller.unwatch(ns, name)
        return view


def _status_reflects(children: KnownChildren, ray: Mapping[str, Any]) -> bool:
    meta = ray.get("metadata") or {}
    owners = [o for o in meta.get("ownerReferences") or [] if o.get("kind") == "LoRATrainingJob"]
    return bool(owners) and children.derived_from(str(owners[0].get("uid")), meta.get("resourceVersion"))


def _needs_polling(runtime: Runtime, status: Mapping[str, Any], settings: Settings) -> bool:
    """Until it ends, when its runtime says so: a Ray job changes where only polling sees it; a KubeRay job's
    trainer is polled for its progress while it runs (KubeRay's own changes come as RayJob events)."""
    phase = status.get("phase")
    return phase not in TERMINAL and runtime.polls(phase, settings)


def stop_ray_job(ctx: Context, ns: str, name: str) -> tuple[str | None, JobInfo | None]:
    """For a deleted runtime-Ray job: stop its Ray job; return (submission id, its state after the stop
    request), (None, None) when nothing was submitted. Under the job's lock, on a fresh read: a
    reconcile that is submitting right now finishes first, and its submission is the one stopped."""
    with _lock(ns, name):
        body = ctx.decided(ctx.kube.get_job(ns, name))
        if body is None:
            return None, None
        return RAY.stop(ctx, body)


def _doc(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(body["metadata"]),
            "spec": body.get("spec") or {}}


# -- the reconcile: validate, the runtime's step, progress, one status write --------------------------------------


def _reconcile(ctx: Context, runtime: Runtime, body: dict[str, Any], poll: bool = False, create_first: bool = False,
               ray: dict[str, Any] | None = None) -> JobView:
    """Reconcile one job; return it with the status it holds now. A `poll` looks at the outside (the RayJob or
    Ray job, the trainer) and leaves the children alone: events bring those back if they go. `create_first`,
    `ray`: see reconcile."""
    current = body.get("status") or {}
    view = JobView(body)
    if current.get("phase") in TERMINAL:
        return view  # finished jobs are history; KubeRay's TTL cleans the cluster up
    now = now_rfc3339()
    job, status = _validate(ctx, body, current, now)
    if job is None:
        return view.with_status(status)
    got = runtime.advance(Step(ctx, body, job, status, now, JobChildren(ctx, body, job), poll=poll,
                               create_first=create_first, seen=ray))
    new, trainer = _with_trainer(ctx, body, job, current, got, now)
    _write(ctx, body, current, new)
    if got.derived_from and ctx.children is not None:
        ctx.children.derived(str(body["metadata"]["uid"]), str(got.derived_from))
    return view.with_status(new, **trainer)


def _validate(ctx: Context, body: dict[str, Any], current: Mapping[str, Any],
              now: str) -> tuple[LoRATrainingJob | None, dict[str, Any]]:
    """(the job, its status with Validated set), or (None, the Failed status written) when the spec is invalid."""
    job, problems = validate_job(_doc(body))
    errors = [p for p in problems if p.severity == "error"]
    if job is None or errors:
        message = "; ".join(f"{p.field}: {p.message}" for p in errors) or "invalid spec"
        cond = Cond(ConditionType.VALIDATED, ConditionStatus.FALSE, Reason.VALIDATION_FAILED, message)
        return None, _fail(ctx, body, cond, now)
    status: dict[str, Any] = dict(current)
    first_time = get_condition(current.get("conditions") or [], ConditionType.VALIDATED) is None
    if first_time and job.spec.lora.sync_mode is None:
        ctx.kube.event(body, EventType.WARNING, Reason.SYNC_MODE_DEFAULTED,
                       "lora.syncMode is not set: using Merge (set it to Merge, Adapter or EngineMerge to silence "
                       "this)")
    status["syncMode"] = str(job.spec.lora.effective_sync_mode)
    status["conditions"] = set_condition(
        current.get("conditions") or [], Cond(ConditionType.VALIDATED, ConditionStatus.TRUE, Reason.VALIDATED,
                                             "the spec passed every rule"), body["metadata"].get("generation"), now)
    return job, status


def _with_trainer(ctx: Context, body: dict[str, Any], job: LoRATrainingJob, current: Mapping[str, Any],
                  got: Advanced, now: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The status with the trainer's progress while it runs, and after one last look when it has just ended (a
    trainer that keeps its control plane up a moment after its last step then shows the final numbers); and
    what the job's adapters learn of the trainer (nothing: it was not read now)."""
    new, url = got.status, got.url
    running = new.get("phase") == Phase.RUNNING
    just_ended = current.get("phase") == Phase.RUNNING and new.get("phase") in TERMINAL
    if not url or not (running or just_ended):
        return new, {}
    new, runs, error = _with_progress(ctx, body, job, new, url, now)
    return new, {"url": url, "runs": runs, "error": error}


def _fail(ctx: Context, body: dict[str, Any], cond: Cond, now: str,
          status: dict[str, Any] | None = None) -> dict[str, Any]:
    current = body.get("status") or {}
    status = dict(status if status is not None else current)
    generation = body["metadata"].get("generation")
    conditions = set_condition(status.get("conditions") or [], cond, generation, now)
    if cond.type is not ConditionType.FAILED:
        failed = Cond(ConditionType.FAILED, ConditionStatus.TRUE, cond.reason, cond.message)
        conditions = set_condition(conditions, failed, generation, now)
    status.update(phase="Failed", conditions=conditions, observedGeneration=generation, completionTime=now)
    _write(ctx, body, current, status)
    return status


def _write(ctx: Context, body: dict[str, Any], current: Mapping[str, Any], new: dict[str, Any]) -> None:
    """Write the status `new` if it differs from `current` (as this operator last decided it), and once it is
    written post an Event for each transition (after the status that shows it, as ever)."""
    if new == current:
        return
    meta = body["metadata"]
    news = transitions(current.get("conditions") or [], new.get("conditions") or [])

    def post() -> None:
        for t in news:
            ctx.kube.event(body, t.type, t.reason, t.message)

    ctx.write_status(body, new, post if news else None)
    if new.get("phase") != current.get("phase"):
        log.info("%s/%s: phase %s -> %s", meta["namespace"], meta["name"], current.get("phase"), new.get("phase"))


# -- progress ----------------------------------------------------------------------------------


def _with_progress(ctx: Context, body: dict[str, Any], job: LoRATrainingJob, status: dict[str, Any], url: str,
                   now: str) -> tuple[dict[str, Any], AdapterRunsState | None, str | None]:
    """The status with the trainer's progress; and for a multi-adapter job the trainer's adapter state (or why
    it is unread), from which progress.activeAdapters is counted."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    try:
        trainer = read_status(fetch(url, ctx.tokens.for_job(str(meta["uid"])), ctx.settings.http_timeout))
    except ProgressUnavailable as e:
        if ctx.progress_errors.get(key) != str(e):
            ctx.progress_errors[key] = str(e)
            log.info("%s/%s: no progress: %s", *key, e)
            if e.unauthorized:
                ctx.kube.event(body, EventType.WARNING, Reason.PROGRESS_UNAVAILABLE, str(e))
        return status, None, str(e)
    ctx.progress_errors.pop(key, None)
    runs, error = adapter_state(ctx, body, url)
    progress = status_progress(trainer)
    if runs is not None:
        progress["activeAdapters"] = runs.active
    shown = (status.get("progress") or {}).get("step")
    if trainer.phase is TrainerPhase.STARTING and isinstance(shown, int) and int(progress.get("step") or 0) < shown:
        # a resubmitted trainer that has not restored its checkpoint yet says step 0: keep what the
        # status shows (the last attempt's progress) until it runs, so the Step column never drops to 0
        return status, runs, error
    new = dict(status)
    new["progress"] = progress
    conds = progress_conditions(progress, job.spec, synced_step=trainer.synced_step)
    new["conditions"] = set_conditions(status.get("conditions") or [], conds, meta.get("generation"), now)
    return new, runs, error
