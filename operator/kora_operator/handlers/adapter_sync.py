"""One level-based reconcile for a LoRAAdapter, and its deregistration when it is deleted.

An adapter lives on its job's trainer: `POST /adapter_runs` registers it once the job runs, `GET
/adapter_runs/state` says how it stands, `DELETE /adapter_runs/{name}` retires it (kora_operator/adapter_runs.py).
Whatever woke it up — its own create or resume, or a reconcile of its job (each poll of a running multi-adapter
job reads the trainer's adapter state once, for all the job's adapters: its reconcile's last step,
`sync_job_adapters`) — the same
`sync_adapter` runs: read the adapter afresh, check SPEC rule 9 against its job, own it to the job, register it
if the trainer does not know it, and mirror the trainer's state of it into its status, written through /status
only when it changed, with an Event for each condition that changed.

The finalizer FINALIZER is on an adapter exactly while its job's trainer holds it: added once the trainer's state
shows it (the POST succeeded), removed by `deregister` after the trainer has retired it and forgotten it, or at
once when the job is gone or has ended, or after a bounded time when its trainer cannot be reached. Our own
finalizer, not kopf's: kopf's one name is the jobs' (jobs.py), and kopf runs no delete handler for an object
its own finalizer does not hold; so a deleted adapter is deregistered from a watch event and then by the
deletion poll loop (Context.deletions) until it is done. Nothing here sleeps.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from kora_operator.adapter_runs import AdapterRuns, Refused, find, mirrored, run_conditions
from kora_operator.api.adapter import LoRAAdapter
from kora_operator.api.job import GROUP, LoRATrainingJob
from kora_operator.api.status import TERMINAL, Phase
from kora_operator.builders.meta import job_owner_reference
from kora_operator.conditions import Cond, get_condition, set_conditions, transitions
from kora_operator.handlers.context import Context, JobView, job_view
from kora_operator.kube import ApiException, now_rfc3339
from kora_operator.progress import ProgressUnavailable
from kora_operator.reasons import ConditionStatus, ConditionType, EventType, Reason
from kora_operator.validation import validate_adapter
from kora_trainer.config.adapter_runs import FINISHED, AdapterPhase, AdapterRunState
from kora_trainer.config.rules import Problem

log = logging.getLogger("kora.adapters")
FINALIZER = f"{GROUP}/deregister-adapter"
DEREGISTER_GIVE_UP_S = 60.0  # how long a delete retries a trainer that cannot be reached (as jobs.py a Ray cluster)
RETIRE_TIMEOUT_S = 600.0  # how long a delete waits for the trainer to retire the adapter (its next step boundary)

_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def _lock(ns: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks[(ns, name)]


# -- what wakes an adapter up --------------------------------------------------------------------------------


def sync_job_adapters(ctx: Context, ns: str, name: str, view: JobView, poll: bool = False) -> None:
    """The adapter step of a job's reconcile (handlers/reconcile.py calls it last): sync each adapter naming the job
    to `view`, the job and its trainer as that reconcile left them. A `poll` of a job without adapter slots
    (multiLora.maxAdapters 0) stops here: an adapter naming it fails rule 9 at its first reconcile, and nothing a
    poll sees changes that. Which adapters name the job: ctx.adapters (the adapters' watch), else a LIST."""
    if poll and (((view.body.get("spec") or {}).get("multiLora") or {}).get("maxAdapters") or 0) == 0:
        return
    try:
        adapters = ctx.adapters.of_job(ns, name) if ctx.adapters is not None else [
            a["metadata"]["name"] for a in ctx.kube.list_adapters(ns) if (a.get("spec") or {}).get("jobName") == name]
    except ApiException as e:
        log.warning("%s/%s: cannot list its LoRAAdapters: %s %s", ns, name, e.status, e.reason)
        return
    for adapter in adapters:
        try:
            sync_adapter(ctx, ns, adapter, view)
        except (kopf.TemporaryError, ApiException) as e:  # one adapter's trouble holds up neither job nor others
            log.info("%s/%s: adapter %s: %s", ns, name, adapter, e)


def reconcile_adapter(ctx: Context, ns: str, name: str) -> None:
    """An adapter's own reconcile (created, or the operator resumed): its job read afresh."""
    body = ctx.kube.get_adapter(ns, name)
    if body is None:
        return
    job_name = str((body.get("spec") or {}).get("jobName") or "")
    sync_adapter(ctx, ns, name, job_view(ctx, ns, job_name) if job_name else None)


def sync_adapter(ctx: Context, ns: str, name: str, view: JobView | None) -> None:
    """Bring one adapter's registration and status in line with its job `view` (None: no such job)."""
    with _lock(ns, name):
        body = ctx.kube.get_adapter(ns, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # gone, or going: deregister's
        current = body.get("status") or {}
        if current.get("phase") in FINISHED:
            return  # finished adapters are history; the trainer keeps their record until they are deleted
        _write(ctx, body, current, _next_status(ctx, body, view))


# -- the decision -----------------------------------------------------------------------------------------------


def _next_status(ctx: Context, body: dict[str, Any], view: JobView | None) -> dict[str, Any]:
    meta, spec = body["metadata"], body.get("spec") or {}
    current = dict(body.get("status") or {})
    job_name = str(spec.get("jobName"))
    job = _parsed_job(view)
    adapter, problems = validate_adapter(_doc(body), job)
    if adapter is None:
        return _failed(body, current, ConditionType.REGISTERED, Reason.VALIDATION_FAILED, _problems(problems))
    if view is None:
        return _pending(body, current, Reason.JOB_NOT_FOUND,
                        f"LoRATrainingJob {job_name} does not exist (yet) in namespace {meta['namespace']}: the "
                        "adapter registers once that job runs")
    _own(ctx, body, view.body)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        return _failed(body, current, ConditionType.REGISTERED, Reason.VALIDATION_FAILED, _problems(errors))
    return _on_trainer(ctx, body, adapter, view, job)


def _on_trainer(ctx: Context, body: dict[str, Any], adapter: LoRAAdapter, view: JobView,
                job: LoRATrainingJob | None) -> dict[str, Any]:
    """A valid adapter of an existing job: registered if the trainer does not hold it while the job may run, its
    status mirrored from the trainer's state of it; Failed if its job ended before it finished."""
    current = dict(body.get("status") or {})
    job_name, job_phase = str((body.get("spec") or {}).get("jobName")), view.status.get("phase")
    run = find(view.runs, str(body["metadata"]["name"])) if view.runs is not None else None
    if run is None and job_phase not in TERMINAL:
        run_or_status = _register(ctx, body, adapter, view, current)
        if isinstance(run_or_status, dict):
            return run_or_status
        run = run_or_status
    status = current if run is None else _mirror(ctx, body, current, run, job)
    if job_phase in TERMINAL and (run is None or run.phase not in FINISHED):
        return _failed(body, status, ConditionType.TRAINING, Reason.JOB_ENDED,
                       f"LoRATrainingJob {job_name} ended ({job_phase}) before this adapter finished")
    return status


def _register(ctx: Context, body: dict[str, Any], adapter: LoRAAdapter, view: JobView,
              current: dict[str, Any]) -> AdapterRunState | dict[str, Any]:
    """POST it to a running job's trainer that does not hold it: its state there, or the status to hold while
    it cannot be registered (the job not running, no free slot, a trainer that cannot be reached) or never can
    be (the trainer's rule 9 said no)."""
    job_name, phase = adapter.spec.job_name, view.status.get("phase")
    if view.url is None:
        if phase == Phase.RUNNING:  # a KubeRay trainer outside the operator's reach (Settings.kuberay_progress)
            return _pending(body, current, Reason.JOB_NOT_RUNNING,
                            f"LoRATrainingJob {job_name} runs, but the operator does not reach its trainer's control "
                            "plane (KORA_KUBERAY_PROGRESS is off): the adapter cannot register")
        return _pending(body, current, Reason.JOB_NOT_RUNNING,
                        f"waiting for LoRATrainingJob {job_name} to run (it is {phase or 'new'}): the adapter "
                        "registers then")
    registered = FINALIZER in (body["metadata"].get("finalizers") or [])
    if view.runs is None:
        if registered:  # it was there at the last look: a trainer slow to answer is no news yet
            log.info("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], view.error)
            return current
        return _pending(body, current, Reason.TRAINER_UNREACHABLE,
                        f"cannot read the adapter state of LoRATrainingJob {job_name}'s trainer: {view.error}")
    name = str(body["metadata"]["name"])
    if registered:
        log.info("%s/%s: the trainer of %s no longer holds it (restarted without a checkpoint?): registering "
                 "it again", body["metadata"]["namespace"], name, job_name)
    client = AdapterRuns(view.url, ctx.tokens.for_job(str(view.body["metadata"]["uid"])), ctx.settings.http_timeout)
    try:
        got = client.register(name, adapter.spec.config())
    except ProgressUnavailable as e:
        return _pending(body, current, Reason.TRAINER_UNREACHABLE, f"registering on {job_name}'s trainer: {e}")
    if not isinstance(got, Refused):
        return got
    if got.no_free_slot:
        return _pending(body, current, Reason.NO_FREE_SLOT,
                        f"LoRATrainingJob {job_name} has no free slot ({got.message}): the adapter registers when "
                        "one frees")
    if got.code == 400:
        return _failed(body, current, ConditionType.REGISTERED, Reason.VALIDATION_FAILED, got.message)
    # 409 "already registered": another reconcile of it registered it just now; the next one mirrors it
    raise kopf.TemporaryError(f"registering on {job_name}'s trainer: {got.code} {got.message}", delay=1)


def _mirror(ctx: Context, body: dict[str, Any], current: dict[str, Any], run: AdapterRunState,
            job: LoRATrainingJob | None) -> dict[str, Any]:
    """The trainer holds it: the finalizer on, its status as the trainer's state says."""
    _add_finalizer(ctx, body)
    generation = body["metadata"].get("generation")
    max_staleness = job.spec.deployment.max_staleness if job is not None else 0
    conds = run_conditions(run, str(body["spec"]["jobName"]), max_staleness)
    status = {**current, **mirrored(run), "observedGeneration": generation}
    status["conditions"] = set_conditions(current.get("conditions") or [], conds, generation, now_rfc3339())
    return status


def _pending(body: dict[str, Any], current: dict[str, Any], reason: Reason, message: str) -> dict[str, Any]:
    """Waiting to register (or, for one that trained, for its job to run again): Registered False, and Training
    False if it has trained."""
    generation = body["metadata"].get("generation")
    conds = [Cond(ConditionType.REGISTERED, ConditionStatus.FALSE, reason, message)]
    if get_condition(current.get("conditions") or [], ConditionType.TRAINING) is not None:
        conds.append(Cond(ConditionType.TRAINING, ConditionStatus.FALSE, reason, message))
    return {**current, "phase": str(AdapterPhase.PENDING), "observedGeneration": generation,
            "conditions": set_conditions(current.get("conditions") or [], conds, generation, now_rfc3339())}


def _failed(body: dict[str, Any], current: dict[str, Any], where: ConditionType, reason: Reason,
            message: str) -> dict[str, Any]:
    generation = body["metadata"].get("generation")
    conds = [Cond(where, ConditionStatus.FALSE, reason, message),
             Cond(ConditionType.FAILED, ConditionStatus.TRUE, reason, message)]
    return {**current, "phase": str(AdapterPhase.FAILED), "observedGeneration": generation,
            "conditions": set_conditions(current.get("conditions") or [], conds, generation, now_rfc3339())}


def _problems(problems: list[Problem]) -> str:
    def where(field: str) -> str:
        return field if field.startswith(("spec.", "metadata.")) else f"spec.{field}"
    return "; ".join(f"{where(p.field)}: {p.message}" for p in problems) or "invalid spec"


def _parsed_job(view: JobView | None) -> LoRATrainingJob | None:
    if view is None:
        return None
    doc = {k: view.body.get(k) for k in ("apiVersion", "kind", "metadata", "spec")}
    try:
        return LoRATrainingJob.model_validate(doc)
    except ValueError:
        return None  # the job fails its own validation, and so ends Failed: its adapters with it


def _doc(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(body["metadata"]),
            "spec": body.get("spec") or {}}


# -- metadata: the owner and the finalizer ------------------------------------------------------------------------


def _patch_metadata(ctx: Context, body: dict[str, Any], **fields: Any) -> None:
    """Merge-patch metadata fields, failing (409: retried) if the adapter changed since it was read; `body`
    takes the new metadata."""
    meta = body["metadata"]
    try:
        got = ctx.kube.patch_adapter(meta["namespace"], meta["name"],
                                     {"metadata": {**fields, "resourceVersion": meta["resourceVersion"]}})
    except ApiException as e:
        raise kopf.TemporaryError(f"patching {sorted(fields)}: {e.status} {e.reason}", delay=1) from e
    body["metadata"] = got["metadata"]


def _own(ctx: Context, body: dict[str, Any], job: Mapping[str, Any]) -> None:
    """Its job as its controller owner: deleting the job deletes it (the garbage collector)."""
    ref = job_owner_reference(job["metadata"])
    refs = body["metadata"].get("ownerReferences") or []
    if ref is None or any(r.get("uid") == ref["uid"] for r in refs):
        return
    others = [r for r in refs if r.get("kind") != "LoRATrainingJob"]  # a namesake deleted before: not ours now
    _patch_metadata(ctx, body, ownerReferences=[*others, ref])


def _add_finalizer(ctx: Context, body: dict[str, Any]) -> None:
    finalizers = body["metadata"].get("finalizers") or []
    if FINALIZER not in finalizers:
        _patch_metadata(ctx, body, finalizers=[*finalizers, FINALIZER])


def _write(ctx: Context, body: dict[str, Any], current: Mapping[str, Any], new: dict[str, Any]) -> None:
    new = {k: v for k, v in new.items() if v is not None}
    if new == current:
        return
    meta = body["metadata"]
    # a merge patch: a field the new status lacks (a freed slot) is removed by sending it as null
    ctx.kube.patch_adapter_status(meta["namespace"], meta["name"], {**{k: None for k in current}, **new})
    for t in transitions(current.get("conditions") or [], new.get("conditions") or []):
        ctx.kube.event(body, t.type, t.reason, t.message)
    if new.get("phase") != current.get("phase"):
        log.info("%s/%s: adapter phase %s -> %s", meta["namespace"], meta["name"], current.get("phase"),
                 new.get("phase"))


# -- deletion ---------------------------------------------------------------------------------------------------


def adapter_deleting(ctx: Context, ns: str, name: str) -> None:
    """A watch event showed a deleted adapter with our finalizer: the deletion poll loop takes it (until it is
    done), and a first try is made now."""
    if ctx.deletions is not None:
        ctx.deletions.watch(ns, name)
    poll_deletion(ctx, ns, name)


def poll_deletion(ctx: Context, ns: str, name: str) -> None:
    if deregister(ctx, ns, name) and ctx.deletions is not None:
        ctx.deletions.unwatch(ns, name)


def deregister(ctx: Context, ns: str, name: str) -> bool:
    """For a deleted adapter that its job's trainer holds: retire it there (DELETE /adapter_runs/{name}: the
    trainer aborts its requests, writes its checkpoint and export and frees its slot at its next step boundary),
    and once the trainer says it has finished, forget it there (DELETE again) and remove the finalizer. True when
    done (or there was nothing to do); False while it waits: call it again. Gives up, removing the finalizer with a
    Warning, when the trainer cannot be reached DEREGISTER_GIVE_UP_S after the delete, or has not retired it
    RETIRE_TIMEOUT_S after (both counted from metadata.deletionTimestamp, so an operator restart changes nothing)."""
    with _lock(ns, name):
        body = ctx.kube.get_adapter(ns, name)
        if body is None or FINALIZER not in (body["metadata"].get("finalizers") or []):
            return True
        job_name = str(body["spec"]["jobName"])
        view = job_view(ctx, ns, job_name)
        gone = _job_gone(view, job_name)
        if gone:
            _release(ctx, body, EventType.NORMAL, Reason.DEREGISTERED, f"{gone}: nothing to deregister from")
            return True
        assert view is not None
        waited = _since(body["metadata"].get("deletionTimestamp"))
        try:
            run = _retire(ctx, body, view)
        except ProgressUnavailable as e:
            if waited >= DEREGISTER_GIVE_UP_S:
                _release(ctx, body, EventType.WARNING, Reason.DEREGISTRATION_ABANDONED,
                         f"deleted without deregistering from {job_name}'s trainer, which may still hold it: {e}")
                return True
            log.info("%s/%s: deregistering from %s's trainer: %s", ns, name, job_name, e)
            return False
        if run is None or run.phase in FINISHED:
            _release(ctx, body, EventType.NORMAL, Reason.DEREGISTERED, _deregistered(job_name, run))
            return True
        current = dict(body.get("status") or {})
        _write(ctx, body, current, _mirror(ctx, body, current, run, _parsed_job(view)))
        if waited >= RETIRE_TIMEOUT_S:
            _release(ctx, body, EventType.WARNING, Reason.DEREGISTRATION_ABANDONED,
                     f"deleted {waited:.0f} s ago and {job_name}'s trainer has not retired it (now {run.phase}): it "
                     "may still hold its slot")
            return True
        return False


def _since(timestamp: str | None) -> float:
    """Seconds since an RFC 3339 time (0 for none)."""
    if not timestamp:
        return 0.0
    return (datetime.now(UTC) - datetime.fromisoformat(timestamp.replace("Z", "+00:00"))).total_seconds()


def _job_gone(view: JobView | None, job_name: str) -> str | None:
    """Why there is no trainer to deregister from (None: there may be one)."""
    if view is None:
        return f"LoRATrainingJob {job_name} is gone"
    if view.body["metadata"].get("deletionTimestamp"):
        return f"LoRATrainingJob {job_name} is being deleted"
    if view.status.get("phase") in TERMINAL:
        return f"LoRATrainingJob {job_name} has ended ({view.status['phase']})"
    return None


def _retire(ctx: Context, body: Mapping[str, Any], view: JobView) -> AdapterRunState | None:
    """One step of the retirement: the adapter's state on the trainer after it (None: the trainer does not hold
    it, or has forgotten it now). Raises ProgressUnavailable when the trainer cannot be asked."""
    if view.url is None or view.runs is None:
        raise ProgressUnavailable(view.error or f"the job is {view.status.get('phase') or 'not running'}")
    name = str(body["metadata"]["name"])
    run = find(view.runs, name)
    if run is None:
        return None
    client = AdapterRuns(view.url, ctx.tokens.for_job(str(view.body["metadata"]["uid"])), ctx.settings.http_timeout)
    if run.phase not in FINISHED and run.phase is not AdapterPhase.RETIRING:
        client.delete(name)  # 202: retiring at the next step boundary (one not loaded yet is Retired at once)
        run = client.get(name)
    if run is not None and run.phase in FINISHED:
        client.delete(name)  # 200: the record is forgotten
    return run


def _deregistered(job_name: str, run: AdapterRunState | None) -> str:
    if run is None:
        return f"{job_name}'s trainer does not hold it"
    export = f"; its export is {run.export_path}" if run.export_path else ""
    return f"deregistered from {job_name}'s trainer: {run.phase} at step {run.step}{export}"


def _release(ctx: Context, body: dict[str, Any], type_: EventType, reason: Reason, message: str) -> None:
    """Remove the finalizer: the delete goes ahead."""
    meta = body["metadata"]
    ctx.kube.event(body, type_, reason, message)
    (log.warning if type_ is EventType.WARNING else log.info)("%s/%s: %s", meta["namespace"], meta["name"], message)
    _patch_metadata(ctx, body, finalizers=[f for f in meta.get("finalizers") or [] if f != FINALIZER])
