"""kopf handlers: LoRATrainingJob create/resume/update/delete, and changes of the RayJobs we own.

Every handler calls the same level-based reconcile (handlers/reconcile.py), whose last step syncs the job's
LoRAAdapters (handlers/adapter_sync.py); none sleeps. The poll loop (handlers/poller.py) calls it too, for jobs whose
state lives outside Kubernetes.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf

from kora_operator.api.job import GROUP, VERSION
from kora_operator.api.status import TERMINAL
from kora_operator.builders.meta import JOB_LABEL, MANAGED_BY
from kora_operator.events import EventPoster
from kora_operator.handlers.adapter_sync import poll_deletion
from kora_operator.handlers.context import Context
from kora_operator.handlers.kopf_state import HandledSpecs, UnmarkedProgress
from kora_operator.handlers.memory import AdapterIndex, KnownChildren
from kora_operator.handlers.poller import Poller
from kora_operator.handlers.reconcile import forget, reconcile, stop_ray_job
from kora_operator.kube import Kube
from kora_operator.metrics import reconciles_in_flight
from kora_operator.runtimes import runtime_of
from kora_operator.runtimes.rayjobs import RayError
from kora_operator.settings import Settings
from kora_operator.statuses import StatusWriter
from kora_operator.tokens import load_tokens

JOBS = (GROUP, VERSION, "loratrainingjobs")
FINALIZER = f"{GROUP}/stop-ray-job"
STOP_GIVE_UP_AFTER = 20  # retries (about a minute) before a delete stops waiting for an unreachable Ray
log = logging.getLogger("kora.handlers")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's bookkeeping writes nothing onto an object while its handlers succeed (handlers/kopf_state.py): its
    # diff base is kept in memory and read back from status.observedGeneration after a restart, its retries go to
    # annotations (the status belongs to the API and to us; status.kopf would be pruned by the schema anyway)
    settings.persistence.progress_storage = UnmarkedProgress(prefix=GROUP)
    settings.persistence.diffbase_storage = memo.handled = HandledSpecs()
    # only runtime-Ray jobs get it (see ray_job_deleted)
    settings.persistence.finalizer = FINALIZER
    # we post our own Events, one per transition; kopf's log-lines-as-events would double them
    settings.posting.enabled = False
    # handlers wait on API round trips, not on CPU: more in flight keep up with a burst (bench/operator_scale.py)
    settings.execution.max_workers = 48
    # after a patch of its own (a retry's progress record, a finalizer) kopf holds an object's next events until
    # the patched version comes back through the watch. In a burst the watch lags more than kopf's 5 s: kopf then
    # took an event older than its patch for the object's current state (with its diff base in annotations that
    # ran the create handler again for 1 job in 3 at 500)
    settings.persistence.consistency_timeout = 30.0
    # no watching of Namespaces and CRDs: the account needs no cluster-wide read rights, at the
    # price that CRDs (ours, KubeRay's) installed after the operator started need a restart
    settings.scanning.disabled = True
    ours: Settings = getattr(memo, "settings", None) or Settings.from_env()
    kube = Kube()
    # Events behind the reconciles' own writes (events.py)
    kube.poster = EventPoster(kube.post_event, busy=lambda: reconciles_in_flight() > 0).start()
    tokens = load_tokens(ours, kube)
    log.info("control-plane tokens are derived from the operator key in %s", tokens.source)
    ctx = Context(kube=kube, tokens=tokens, settings=ours, adapters=AdapterIndex(),
                  children=KnownChildren(ours.children_recheck) if ours.children_recheck > 0 else None,
                  # job statuses behind the reconciles too, coalesced per job (statuses.py)
                  statuses=StatusWriter(kube.patch_job_status, busy=lambda: reconciles_in_flight() > 0).start())
    ctx.poller = Poller(ours.poll_interval, lambda ns, name: reconcile(ctx, ns, name, trigger="poll")).start()
    ctx.deletions = Poller(ours.poll_interval, lambda ns, name: poll_deletion(ctx, ns, name)).start()
    memo.ctx = ctx


@kopf.on.cleanup()
def shutdown(memo: kopf.Memo, **_: Any) -> None:
    ctx: Context | None = getattr(memo, "ctx", None)
    for poller in (ctx.poller, ctx.deletions) if ctx is not None else ():
        if poller is not None:
            poller.stop()
    if ctx is not None and ctx.statuses is not None:
        # writes the statuses still waiting (a restart reads status.observedGeneration: handlers/kopf_state.py), and
        # hands their transitions' Events to the poster
        ctx.statuses.stop()
    if ctx is not None and ctx.kube.poster is not None:
        ctx.kube.poster.stop()  # posts the Events still waiting


@kopf.index("ray.io", "v1", "rayjobs", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
def ray_job_owners(body: kopf.Body, **_: Any) -> dict[str, None]:
    """The uids of the jobs whose RayJob exists. kopf fills its indexes from its first listings before it calls
    any other handler, so every resume after a restart finds its job's RayJob here, at no API call of its own."""
    return {str(o["uid"]): None for o in body.metadata.get("ownerReferences", []) if o.get("kind") == "LoRATrainingJob"}


@kopf.on.resume(*JOBS)
@kopf.on.create(*JOBS)
def job_created(namespace: str | None, name: str, memo: Any, reason: str, body: kopf.Body, uid: str,
                **kwargs: Any) -> None:
    ctx: Context = memo.ctx
    owners: kopf.Index[str, None] = kwargs["ray_job_owners"]  # kopf passes each index by its function's name
    if reason == "resume" and ctx.children is not None and uid in owners:
        # the RayJob is made last, after the ConfigMap, both Secrets and the NetworkPolicy (each made or the
        # reconcile stops): the resume reads only the RayJob, as a reconcile does while children are known. One
        # deleted while the operator was down comes back at the first reconcile after the recheck time, as one
        # deleted while it runs; a RayJob at once (it is not in the index, so nothing is taken as known). Without
        # this each resume checked every child: 5 calls a job after every restart, 2 of them Secret creates
        # answering 409 (the operator may not read Secrets, nor list them).
        ctx.children.remember_if_new(uid)
        if ctx.children.derived_any(uid):
            return  # its RayJob's event from kopf's first listing came first and has reconciled it since the start
    # a job being created is reconciled as kopf was handed it (reconcile.reconcile says why that is safe)
    given = copy.deepcopy(dict(body)) if reason == "create" else None
    reconcile(ctx, str(namespace), name, trigger=reason, body=given)


@kopf.on.update(*JOBS, field="spec")
def job_updated(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    reconcile(memo.ctx, str(namespace), name, trigger="update")


@kopf.on.event(*JOBS)
async def job_event(type: str | None, uid: str | None, namespace: str | None, name: str | None, memo: Any,
                    **_: Any) -> None:
    # async: it runs for every event of every job and never waits, so kopf need not hand it to a worker thread
    if type != "DELETED" or not uid:
        return
    handled: HandledSpecs | None = getattr(memo, "handled", None)
    if handled is not None:
        handled.forget(uid)  # kopf's diff base of a job that is gone
    ctx: Context | None = getattr(memo, "ctx", None)
    if ctx is not None and ctx.statuses is not None:
        ctx.statuses.forget(str(namespace), str(name), uid)  # a status still waiting for it: nothing to write it to


# optional: no finalizer. Children carry ownerReferences, so the garbage collector removes them
# even when the operator is down; a finalizer would only make deletes hang on us.
def _ray_job_may_run(spec: kopf.Spec, status: kopf.Status, **_: Any) -> bool:
    """A runtime that must stop the trainer itself (Ray), and not finished: a finished job's Ray job has ended
    (Succeeded and Failed are only reached from a terminal Ray job, or before any submission)."""
    return runtime_of(spec).stops_on_delete and status.get("phase") not in TERMINAL


@kopf.on.delete(*JOBS, optional=True)
def job_deleted(namespace: str | None, name: str, memo: Any, spec: kopf.Spec, status: kopf.Status,
                uid: str | None, **_: Any) -> None:
    if not _ray_job_may_run(spec, status):  # else ray_job_deleted forgets it, once its Ray job has stopped
        forget(getattr(memo, "ctx", None), str(namespace), name, uid)
    log.info("%s/%s deleted; the garbage collector removes its children", namespace, name)


# runtime Ray only, and with a finalizer while its Ray job may run: nothing garbage-collects a Ray
# job on a cluster outside Kubernetes, so the job stays (Terminating) until its Ray job has stopped.
# kopf drops the finalizer once the job has finished. If the Ray cluster is unreachable for about a
# minute the delete goes ahead, and the log says what may still run.
@kopf.on.delete(*JOBS, when=_ray_job_may_run, backoff=3)
def ray_job_deleted(namespace: str | None, name: str, memo: Any, retry: int, uid: str | None, **_: Any) -> None:
    ctx: Context = memo.ctx
    try:
        sub, info = stop_ray_job(ctx, str(namespace), name)
    except RayError as e:
        if retry >= STOP_GIVE_UP_AFTER:
            log.warning("%s/%s deleted without stopping its Ray job, which may still run: %s", namespace, name, e)
            forget(ctx, str(namespace), name, uid)
            return
        raise kopf.TemporaryError(f"stopping the Ray job: {e}", delay=3) from e
    if info is not None and not info.terminal:
        raise kopf.TemporaryError(f"waiting for Ray job {sub} to stop (now {info.status})", delay=1)
    forget(ctx, str(namespace), name, uid)
    if sub:
        log.info("%s/%s deleted: its Ray job %s has ended", namespace, name, sub)


@kopf.on.event("ray.io", "v1", "rayjobs", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
def ray_job_changed(body: kopf.Body, namespace: str | None, memo: Any, type: str | None, **_: Any) -> None:
    ctx: Context = memo.ctx
    owners = [o for o in body.metadata.get("ownerReferences", []) if o.get("kind") == "LoRATrainingJob"]
    job = owners[0]["name"] if owners else body.metadata.labels.get(JOB_LABEL)
    if not job:
        return
    if type == "DELETED":
        if ctx.children is not None and owners:
            ctx.children.forget(str(owners[0].get("uid")))  # its reconcile makes the RayJob again
        reconcile(ctx, str(namespace), str(job), trigger="rayjob")
    else:  # the RayJob as watched: its reconcile need not read it again
        if ctx.children is not None and owners:
            # the same as a resume's (job_created): the RayJob of a job this process has not seen yet, most often
            # from kopf's first listing, which may come before the job's resume
            ctx.children.remember_if_new(str(owners[0].get("uid")))
        # a copy deep enough for what a reconcile writes into it (runtimes/kuberay.align_ray_job: top-level spec
        # fields); the rest is only read, and a deep copy of every RayJob event was a good part of the operator's CPU
        # in a burst
        raw = dict(body)
        reconcile(ctx, str(namespace), str(job), trigger="rayjob", ray={**raw, "spec": dict(raw.get("spec") or {})})
