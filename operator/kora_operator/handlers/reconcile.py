"""One level-based reconcile for a LoRATrainingJob, whatever woke it up (create, resume after a
restart, a spec update, a change of its RayJob, or the poll loop).

It reads the job afresh, creates whatever child is missing (deterministic names: a second
attempt finds the first one's objects), nudges the RayJob's lifecycle fields to the spec (runtime
KubeRay) or the Ray job's submission to its state (runtime Ray, runtimes/ray.py), reads the
trainer's progress while it runs, derives the status and writes it, through /status, only when it
changed: handed to the status writer (statuses.py: behind the reconciles, coalesced per job), and derived from
the status as this operator last decided it (the API's, with its writes still pending applied), so that a
write not made yet neither repeats a transition's Event nor redoes work. Transient API trouble raises
kopf.TemporaryError; nothing here sleeps.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kora_operator.adapter_runs import AdapterRuns
from kora_operator.api.job import LoRATrainingJob, RuntimeKind
from kora_operator.api.status import Phase
from kora_operator.builders.children import build_children
from kora_operator.builders.names import ray_job_name
from kora_operator.builders.rayjob import mutable_spec
from kora_operator.builders.secret import new_token
from kora_operator.conditions import Cond, get_condition, set_condition, set_conditions, transitions
from kora_operator.handlers.memory import AdapterIndex, KnownChildren
from kora_operator.handlers.poller import Poller
from kora_operator.kube import ApiException, Kube, now_rfc3339
from kora_operator.metrics import CHILDREN_CREATED, observe_reconcile
from kora_operator.phase import TERMINAL, Observation, next_status, observe
from kora_operator.progress import ProgressUnavailable, fetch, progress_conditions, read_status, status_progress
from kora_operator.reasons import CREATED, FAILED_TO_CREATE, ConditionType, EventType, Reason
from kora_operator.runtimes import kuberay
from kora_operator.runtimes import ray as rayrt
from kora_operator.runtimes.rayjobs import (
    JobInfo,
    RayError,
    RayJobsClient,
    RayRejected,
    RayUnauthorized,
    ray_auth_token,
)
from kora_operator.settings import Settings
from kora_operator.statuses import StatusWriter
from kora_operator.tokens import Tokens
from kora_operator.validation import validate_job
from kora_trainer.config.adapter_runs import AdapterRunsState
from kora_trainer.config.status import TrainerPhase

log = logging.getLogger("kora.reconcile")
RETRY_DELAY = 5.0  # seconds kopf waits before retrying after transient API trouble

# Handlers for one job (its own events, its RayJob's) may run in parallel threads; one at a time
# per job keeps the read-decide-write of the status from racing itself.
_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def _lock(ns: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks[(ns, name)]


@dataclass
class Context:
    """What a reconcile needs besides the job: the API, the token source, the operator's settings,
    and the poll loops (None: nothing polls, e.g. in a one-shot reconcile): the jobs', and the one that
    deregisters deleted LoRAAdapters (handlers/adapter_sync.py); what the operator remembers between reconciles
    (handlers/memory.py; None: nothing is remembered, every reconcile checks every child and LISTs adapters); the
    status writer (statuses.py; None: each status is written before the reconcile goes on)."""

    kube: Kube
    tokens: Tokens
    settings: Settings = field(default_factory=Settings)
    poller: Poller | None = None
    deletions: Poller | None = None
    children: KnownChildren | None = None
    adapters: AdapterIndex | None = None
    statuses: StatusWriter | None = None
    ray_token: Callable[[], str | None] = ray_auth_token
    # the last progress trouble per job, so that it is logged (and a refused token posted) once
    progress_errors: dict[tuple[str, str], str] = field(default_factory=dict)

    def ray_client(self, address: str) -> RayJobsClient:
        return RayJobsClient(address, self.ray_token(), self.settings.http_timeout)

    def decided(self, body: dict[str, Any] | None) -> dict[str, Any] | None:
        """The job `body` as the API server returned it, with the status this operator last decided for it (its
        writes not made yet applied on top; the API's own after a restart)."""
        if body is None or self.statuses is None:
            return body
        meta = body["metadata"]
        return {**body, "status": self.statuses.status(meta["namespace"], meta["name"], meta.get("uid"),
                                                       body.get("status"))}

    def write_status(self, body: Mapping[str, Any], status: dict[str, Any],
                     then: Callable[[], None] | None = None) -> None:
        """The job's new status, through the writer (`then` once it is written), or here and now."""
        meta = body["metadata"]
        if self.statuses is not None:
            self.statuses.put(meta["namespace"], meta["name"], meta.get("uid"), status, then)
            return
        self.kube.patch_job_status(meta["namespace"], meta["name"], status)
        if then is not None:
            then()

    def write_status_now(self, body: Mapping[str, Any], patch: dict[str, Any]) -> None:
        """A patch that must be stored before the caller goes on, after the job's pending status (statuses.py)."""
        meta = body["metadata"]
        if self.statuses is not None:
            self.statuses.write_now(meta["namespace"], meta["name"], meta.get("uid"), patch)
        else:
            self.kube.patch_job_status(meta["namespace"], meta["name"], patch)


@dataclass(frozen=True)
class JobView:
    """A job as its LoRAAdapters see it: the object (with the status just derived), its trainer's control-plane
    URL when the trainer was read (None otherwise: the job does not run, or the operator does not reach it), and
    for a multi-adapter job the trainer's adapter state (None when unread: `error` says why)."""

    body: dict[str, Any]
    url: str | None = None
    runs: AdapterRunsState | None = None
    error: str | None = None

    @property
    def status(self) -> dict[str, Any]:
        return dict(self.body.get("status") or {})

    def with_status(self, status: dict[str, Any], **trainer: Any) -> JobView:
        return JobView({**self.body, "status": status}, **trainer)


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
    """Reconcile one job; return how it stands now (None: gone or being deleted, or nothing to do).

    `body`: the job as kopf's create handler was handed it, just listed or watched. A job being created has had
    no reconcile that could have changed it since (none finished: kopf calls create until one does), so it is
    not read again, and its children are created without asking first whether they exist. `ray`: its RayJob as
    a watch event just showed it, used instead of reading it when the children are known to exist; nothing is
    done when the job's status was derived from this very version of it (the echo of the create that made it:
    in a burst its event waits here, on the lock, while that reconcile finishes)."""
    with observe_reconcile(trigger), _lock(ns, name):
        if ray is not None and ctx.children is not None and _status_reflects(ctx.children, ray):
            return None
        body = ctx.decided(body if body is not None else ctx.kube.get_job(ns, name))
        if body is None or body["metadata"].get("deletionTimestamp"):
            if ctx.poller is not None:
                ctx.poller.unwatch(ns, name)
            return None  # gone or going: the garbage collector takes the children (a finalizer stops a Ray job)
        view = _reconcile(ctx, body, poll=trigger == "poll", create_first=trigger == "create", ray=ray)
        if ctx.poller is not None:
            if _needs_polling(body, view.status, ctx.settings.kuberay_progress):
                ctx.poller.watch(ns, name)
            else:
                ctx.poller.unwatch(ns, name)
        return view


def _status_reflects(children: KnownChildren, ray: Mapping[str, Any]) -> bool:
    meta = ray.get("metadata") or {}
    owners = [o for o in meta.get("ownerReferences") or [] if o.get("kind") == "LoRATrainingJob"]
    return bool(owners) and children.derived_from(str(owners[0].get("uid")), meta.get("resourceVersion"))


def job_view(ctx: Context, ns: str, name: str) -> JobView | None:
    """A job as its adapters see it, read afresh without reconciling it (None: no such job): its trainer's URL
    and adapter state while it runs."""
    body = ctx.decided(ctx.kube.get_job(ns, name))
    if body is None:
        return None
    url = trainer_url(ctx, body)
    if url is None:
        return JobView(body)
    return JobView(body, url, *_adapter_state(ctx, body, url))


def trainer_url(ctx: Context, body: Mapping[str, Any]) -> str | None:
    """The control-plane URL of a Running job's trainer, found as its poll finds it; None when the job does
    not run, or runs on KubeRay and the operator does not reach KubeRay trainers (Settings.kuberay_progress)."""
    status = body.get("status") or {}
    if status.get("phase") != Phase.RUNNING:
        return None
    runtime = (body.get("spec") or {}).get("runtime") or {}
    if runtime.get("kind") != RuntimeKind.RAY:
        return kuberay.control_url(status, body["metadata"]["namespace"]) if ctx.settings.kuberay_progress else None
    sub, address = status.get("rayJobName"), runtime.get("address")
    if not sub or not address:
        return None
    try:
        info = ctx.ray_client(str(address)).get(str(sub))
    except RayError:
        info = None  # the port the submission would have been given; the trainer is likely unreachable too
    return rayrt.control_url(str(address), rayrt.recorded_port(info, str(sub), ctx.settings.ray_control_ports))


def stop_ray_job(ctx: Context, ns: str, name: str) -> tuple[str | None, JobInfo | None]:
    """For a deleted runtime-Ray job: stop its Ray job; return (submission id, its state after the stop
    request), (None, None) when nothing was submitted. Under the job's lock, on a fresh read: a
    reconcile that is submitting right now finishes first, and its submission is the one stopped."""
    with _lock(ns, name):
        body = ctx.decided(ctx.kube.get_job(ns, name))
        if body is None:
            return None, None
        sub = (body.get("status") or {}).get("rayJobName")
        address = ((body.get("spec") or {}).get("runtime") or {}).get("address")
        if not sub or not address:
            return None, None
        client = ctx.ray_client(str(address))
        info = client.get(str(sub))
        if info is not None and not info.terminal:
            client.stop(str(sub))
            info = client.get(str(sub))
        return str(sub), info


def _needs_polling(body: Mapping[str, Any], status: Mapping[str, Any] | None, kuberay_progress: bool) -> bool:
    """A runtime-Ray job until it ends (only polling sees its Ray job change); a KubeRay job while its
    trainer runs, for its progress (KubeRay's own changes come as RayJob events)."""
    phase = (status or {}).get("phase")
    if status is None or phase in TERMINAL:
        return False
    ray_runtime = ((body.get("spec") or {}).get("runtime") or {}).get("kind") == RuntimeKind.RAY
    return ray_runtime or (kuberay_progress and phase == Phase.RUNNING)


def _doc(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(body["metadata"]),
            "spec": body.get("spec") or {}}


def _reconcile(ctx: Context, body: dict[str, Any], poll: bool = False, create_first: bool = False,
               ray: dict[str, Any] | None = None) -> JobView:
    """Reconcile one job; return it with the status it holds now. A `poll` looks at the outside (the RayJob or
    Ray job, the trainer) and leaves the children alone: events bring those back if they go. `create_first`,
    `ray`: see reconcile."""
    kube = ctx.kube
    meta, current = body["metadata"], body.get("status") or {}
    generation = meta.get("generation")
    view = JobView(body)
    if current.get("phase") in TERMINAL:
        return view  # finished jobs are history; KubeRay's TTL cleans the cluster up
    now = now_rfc3339()
    job, problems = validate_job(_doc(body))
    errors = [p for p in problems if p.severity == "error"]
    if job is None or errors:
        message = "; ".join(f"{p.field}: {p.message}" for p in errors) or "invalid spec"
        return view.with_status(
            _fail(ctx, body, Cond(ConditionType.VALIDATED, "False", Reason.VALIDATION_FAILED, message), now))
    status: dict[str, Any] = dict(current)
    first_time = get_condition(current.get("conditions") or [], ConditionType.VALIDATED) is None
    if first_time and job.spec.lora.sync_mode is None:
        kube.event(body, EventType.WARNING, Reason.SYNC_MODE_DEFAULTED,
                   "lora.syncMode is not set: using Merge (set it to Merge, Adapter or EngineMerge to silence this)")
    status["syncMode"] = str(job.spec.lora.effective_sync_mode)
    status["conditions"] = set_condition(
        current.get("conditions") or [], Cond(ConditionType.VALIDATED, "True", Reason.VALIDATED,
                                             "the spec passed every rule"), generation, now)
    ray_version = None  # of the RayJob the status is derived from (runtime KubeRay)
    if job.spec.runtime.kind is RuntimeKind.RAY:
        if not poll:
            _ensure_children(ctx, body, job, create_first)  # the ConfigMap (the rendered config), the Secret
        new, url = _reconcile_ray(ctx, body, job, status, now)
    else:
        ray_name = ray_job_name(meta["name"])
        if poll:  # a poll leaves the children alone while the RayJob exists
            ray = kube.get_ray_job(meta["namespace"], ray_name) or _ensure_children(ctx, body, job)
        else:
            ray = _ensure_children(ctx, body, job, create_first, ray)
        ray_status = ray.get("status") if ray else None
        ray_version = ((ray or {}).get("metadata") or {}).get("resourceVersion")
        new = next_status(status, observe(ray_name, ray_status, job.spec.suspend), ray_status,
                          ray_name=ray_name, generation=generation, now=now)
        url = kuberay.control_url(new, meta["namespace"]) if ctx.settings.kuberay_progress else None
    # progress while the trainer runs, and one last look when it has just ended (a trainer that
    # keeps its control plane up a moment after its last step then shows the final numbers)
    trainer: dict[str, Any] = {}  # what its adapters learn of the trainer: it was read only now
    if url and (new.get("phase") == Phase.RUNNING or (current.get("phase") == Phase.RUNNING
                                                      and new.get("phase") in TERMINAL)):
        new, runs, error = _with_progress(ctx, body, job, new, url, now)
        trainer = {"url": url, "runs": runs, "error": error}
    _write(ctx, body, current, new)
    if ray_version and ctx.children is not None:
        ctx.children.derived(str(meta["uid"]), str(ray_version))
    return view.with_status(new, **trainer)


def _ensure_children(ctx: Context, body: dict[str, Any], job: LoRATrainingJob, create_first: bool = False,
                     seen: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Create what is missing; return the RayJob as it stands (None for runtime Ray: it has none).

    The Secrets are never read: create answers 409 when one exists, which is all we need to know, and
    so the operator's account may create Secrets but needs no right to read any. The token is
    derived from the job's uid (tokens.py): the operator can compute it again whenever it polls. The
    engines' admin key is random: a fresh one is offered each time, and only the first create keeps one,
    so a job's key never changes while its Secret lives.

    Children all seen within ctx.children's recheck time are not checked again: only the RayJob is read, or
    taken as `seen` (its watch event), and a deleted one forgets them (jobs.ray_job_changed). `create_first`
    (a job being created): each child is created without a GET before; the RayJob is read only if its create
    answers 409.
    """
    kube, uid = ctx.kube, str(body["metadata"]["uid"])
    if ctx.children is not None and ctx.children.known(uid):
        if job.spec.runtime.kind is not RuntimeKind.KUBERAY:
            return None
        have = seen or kube.get_ray_job(body["metadata"]["namespace"], ray_job_name(body["metadata"]["name"]))
        if have is not None:
            _align_ray_job(kube, body, job, have)
            return have
        ctx.children.forget(uid)  # gone since (its watch event is yet to come): make it again
    ray: dict[str, Any] | None = None
    made: list[tuple[str, str]] = []  # (kind, name) of what this reconcile created: one Event says it
    for child in build_children(job, token=ctx.tokens.for_job(uid), engine_key=new_token(),
                                peers=ctx.settings.network_peers()):
        kind = child["kind"]
        existing = None if kind == "Secret" or create_first else kube.get_child(child)
        if existing is None:
            try:
                created = kube.create_child(child)
            except ApiException as e:
                _created_event(kube, body, made)
                kube.event(body, EventType.WARNING, FAILED_TO_CREATE[kind],
                           f"creating {kind} {child['metadata']['name']} failed: {e.status} {e.reason}")
                raise kopf.TemporaryError(f"creating {kind}: {e.status} {e.reason}", delay=RETRY_DELAY) from e
            if created is not None:  # None: it was there already (a Secret, a create-first, or a race)
                CHILDREN_CREATED.labels(kind).inc()
                made.append((kind, child["metadata"]["name"]))
                existing = created
            elif kind == "RayJob":  # the others' existence is all that matters
                existing = kube.get_child(child)
        if kind == "RayJob":
            ray = existing
            if ray is not None:
                _align_ray_job(kube, body, job, ray)
    _created_event(kube, body, made)
    if ctx.children is not None and (ray is not None or job.spec.runtime.kind is not RuntimeKind.KUBERAY):
        ctx.children.remember(uid)
    return ray


def _created_event(kube: Kube, body: dict[str, Any], made: list[tuple[str, str]]) -> None:
    """One Event for the children one reconcile made: Created<Kind> for one (a child re-made after a delete),
    CreatedChildren naming each for several (a new job's five: one API write, not five, the same words)."""
    if not made:
        return
    reason = CREATED[made[0][0]] if len(made) == 1 else Reason.CREATED_CHILDREN
    kube.event(body, EventType.NORMAL, reason, "created " + ", ".join(f"{kind} {name}" for kind, name in made))


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


def _fail(ctx: Context, body: dict[str, Any], cond: Cond, now: str,
          status: dict[str, Any] | None = None) -> dict[str, Any]:
    current = body.get("status") or {}
    status = dict(status if status is not None else current)
    generation = body["metadata"].get("generation")
    conditions = set_condition(status.get("conditions") or [], cond, generation, now)
    if cond.type is not ConditionType.FAILED:
        conditions = set_condition(conditions, Cond(ConditionType.FAILED, "True", cond.reason, cond.message),
                                   generation, now)
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


# -- runtime Ray -------------------------------------------------------------------------------


def _reconcile_ray(ctx: Context, body: dict[str, Any], job: LoRATrainingJob, status: dict[str, Any],
                   now: str) -> tuple[dict[str, Any], str | None]:
    """Move the job's Ray job submission along (runtimes/ray.py decides); return the next status and
    the trainer's control-plane URL."""
    meta = body["metadata"]
    address = str(job.spec.runtime.address)
    client = ctx.ray_client(address)
    sub = str(status.get("rayJobName") or rayrt.submission_id(str(meta["uid"])))
    restarts = int(status.get("restarts") or 0)
    info = None
    submitted = False
    try:
        info = client.get(sub)
        decision = rayrt.decide(info, sub=sub, address=address, suspend=job.spec.suspend, phase=status.get("phase"),
                                restarts=restarts, backoff_limit=job.spec.backoff_limit)
        obs = decision.obs
        if decision.action is rayrt.Action.SUBMIT:
            if status.get("rayJobName") != sub:  # named before it exists: a delete then knows what to stop
                ctx.write_status_now(body, {"rayJobName": sub})
            _submit(ctx, client, body, job, sub)
            submitted = True
        elif decision.action is rayrt.Action.STOP:
            if client.stop(sub):
                ctx.kube.event(body, EventType.NORMAL, Reason.STOPPED_RAY_JOB,
                               f"stopped Ray job {sub} (spec.suspend is true)")
        elif decision.action in (rayrt.Action.RETRY, rayrt.Action.RESUME):
            failed, sub = sub, rayrt.next_submission_id(sub)
            if decision.action is rayrt.Action.RETRY:
                restarts += 1
                ctx.kube.event(body, EventType.WARNING, Reason.TRAINER_FAILED,
                               f"restart {restarts} of {job.spec.backoff_limit}: resubmitting as {sub}; "
                               f"{rayrt.failure_message(info) if info else failed}")
            # the new id is written before it is submitted: an operator that dies in between finds
            # the id in the status, sees no such Ray job and submits it, never a second one
            ctx.write_status_now(body, {"rayJobName": sub, "restarts": restarts})
            info = None
            _submit(ctx, client, body, job, sub)
            submitted = True
    except RayRejected as e:
        obs = Observation(Phase.PENDING, [Cond(ConditionType.TRAINING, "False", Reason.SUBMISSION_FAILED,
                                                    str(e))])
    except RayError as e:
        reason = Reason.RAY_UNAUTHORIZED if isinstance(e, RayUnauthorized) else Reason.RAY_UNREACHABLE
        obs = rayrt.unreachable(status.get("phase"), reason, str(e))
    seen = {"dashboardURL": address}
    if info is not None and info.start_time and not status.get("startTime"):
        seen["startTime"] = info.start_time
    # rayJobName names a submission that exists (the delete handler stops it), or the one being made
    known = info is not None or submitted or status.get("rayJobName") == sub
    new = next_status(status, obs, seen, ray_name=sub if known else None, generation=meta.get("generation"),
                      now=now, restarts=restarts)
    port = rayrt.recorded_port(info, sub, ctx.settings.ray_control_ports)
    return new, rayrt.control_url(address, port)


def _submit(ctx: Context, client: RayJobsClient, body: dict[str, Any], job: LoRATrainingJob, sub: str) -> None:
    port = rayrt.control_port(sub, ctx.settings.ray_control_ports)
    request = rayrt.build_submission(job, sub=sub, token=ctx.tokens.for_job(str(body["metadata"]["uid"])),
                                     port=port, trainer_command=ctx.settings.trainer_command,
                                     linger_s=ctx.settings.linger_s)
    try:
        made = client.submit(request)
    except RayRejected as e:
        ctx.kube.event(body, EventType.WARNING, Reason.FAILED_TO_SUBMIT_RAY_JOB, str(e))
        raise
    if made:
        ctx.kube.event(body, EventType.NORMAL, Reason.SUBMITTED_RAY_JOB,
                       f"submitted the trainer as Ray job {sub} to {client.address} (control plane on port {port})")


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
    runs, error = _adapter_state(ctx, body, url)
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


def _adapter_state(ctx: Context, body: Mapping[str, Any], url: str) -> tuple[AdapterRunsState | None, str | None]:
    """GET /adapter_runs/state of a multi-adapter job's trainer: (the state, None) or (None, why not)."""
    if not int(((body.get("spec") or {}).get("multiLora") or {}).get("maxAdapters") or 0):
        return None, "the job is not a multi-adapter one (multiLora.maxAdapters is 0)"
    client = AdapterRuns(url, ctx.tokens.for_job(str(body["metadata"]["uid"])), ctx.settings.http_timeout)
    try:
        return client.state(), None
    except ProgressUnavailable as e:
        return None, str(e)
