"""What the reconciles share: the operator's means (`Context`), and a job as its LoRAAdapters see it (`JobView`,
read by `job_view`). The job's reconcile (handlers/reconcile.py) and the adapters' sync (handlers/adapter_sync.py)
both import this; neither imports the other's entry (the job's reconcile calls the adapter sync as its last step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kora_operator.adapter_runs import AdapterRuns
from kora_operator.api.status import Phase
from kora_operator.handlers.memory import AdapterIndex, KnownChildren
from kora_operator.handlers.poller import Poller
from kora_operator.kube import Kube
from kora_operator.progress import ProgressUnavailable
from kora_operator.runtimes import runtime_of
from kora_operator.runtimes.rayjobs import RayJobsClient, ray_auth_token
from kora_operator.settings import Settings
from kora_operator.statuses import StatusWriter
from kora_operator.tokens import Tokens
from kora_trainer.config.adapter_runs import AdapterRunsState


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


def job_view(ctx: Context, ns: str, name: str) -> JobView | None:
    """A job as its adapters see it, read afresh without reconciling it (None: no such job): its trainer's URL
    and adapter state while it runs."""
    body = ctx.decided(ctx.kube.get_job(ns, name))
    if body is None:
        return None
    url = trainer_url(ctx, body)
    if url is None:
        return JobView(body)
    return JobView(body, url, *adapter_state(ctx, body, url))


def trainer_url(ctx: Context, body: Mapping[str, Any]) -> str | None:
    """The control-plane URL of a Running job's trainer, found as its poll finds it; None when the job does
    not run, or runs on KubeRay and the operator does not reach KubeRay trainers (Settings.kuberay_progress)."""
    if (body.get("status") or {}).get("phase") != Phase.RUNNING:
        return None
    return runtime_of(body.get("spec") or {}).trainer_url(ctx, body)


def adapter_state(ctx: Context, body: Mapping[str, Any], url: str) -> tuple[AdapterRunsState | None, str | None]:
    """GET /adapter_runs/state of a multi-adapter job's trainer: (the state, None) or (None, why not)."""
    if (((body.get("spec") or {}).get("multiLora") or {}).get("maxAdapters") or 0) == 0:  # an int, or auto
        return None, "the job is not a multi-adapter one (multiLora.maxAdapters is 0)"
    client = AdapterRuns(url, ctx.tokens.for_job(str(body["metadata"]["uid"])), ctx.settings.http_timeout)
    try:
        return client.state(), None
    except ProgressUnavailable as e:
        return None, str(e)
