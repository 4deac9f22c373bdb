"""What every runtime answers to, and what the reconcile hands it (kubeflow trainer's runtime plugins).

A reconcile chooses the runtime once (runtimes.runtime_of) and from then on asks it, never `if kind is ...`:
`advance` makes what the runtime needs and reads how the trainer stands, `trainer_url` finds a running
trainer's control plane, `polls` says whether the poll loop must look again, `stops_on_delete` whether a
deleted job waits for the runtime to stop its trainer. The runtimes take the operator's means (`Operator`) and
the job's children (`Children`) as protocols, so that they import nothing from handlers/.

`Observation` and `next_status` are the one path from what a runtime saw to the job's next status: KubeRay
observes its RayJob's status (runtimes/kuberay.py), Ray its Jobs API submission (runtimes/ray.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kora_operator.api.job import LoRATrainingJob, RuntimeKind
from kora_operator.api.status import TERMINAL, Phase
from kora_operator.conditions import Cond, set_conditions
from kora_operator.kube import Kube
from kora_operator.runtimes.rayjobs import RayJobsClient
from kora_operator.settings import Settings
from kora_operator.tokens import Tokens


@dataclass(frozen=True)
class Observation:
    phase: Phase
    conditions: list[Cond] = field(default_factory=list)
    terminal_time: str | None = None  # when the trainer ended, if it did


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


def _restarts(ray: Mapping[str, Any], phase: Phase) -> int:
    """Retries KubeRay made: each failed attempt but a final one counts as a restart."""
    failed = int(ray.get("failed") or 0)
    return max(0, failed - 1) if phase is Phase.FAILED else failed


class Operator(Protocol):
    """The operator's means a runtime uses (handlers/context.py's Context is one)."""

    kube: Kube
    tokens: Tokens
    settings: Settings

    def ray_client(self, address: str) -> RayJobsClient: ...

    def write_status_now(self, body: Mapping[str, Any], patch: dict[str, Any]) -> None: ...


class Children(Protocol):
    """One job's children in Kubernetes (handlers/children.py): the ConfigMap, the Secrets, the NetworkPolicy, and
    for KubeRay the RayJob; and whether the operator remembers them all to exist (handlers/memory.py)."""

    def known(self) -> bool: ...

    def remember(self) -> None: ...

    def forget(self) -> None: ...

    def create(self, create_first: bool = False) -> dict[str, Any] | None:
        """Create what is missing; return the RayJob as it stands (None: the runtime has none, or it is not
        there)."""
        ...


@dataclass(frozen=True)
class Step:
    """One reconcile of one valid job, as its runtime is handed it. A `poll` looks at the outside and leaves the
    children alone; `create_first`, `seen` (the RayJob as its watch event showed it): handlers/reconcile.py."""

    ops: Operator
    body: dict[str, Any]
    job: LoRATrainingJob
    status: dict[str, Any]  # the status so far (Validated set), the next one is derived from
    now: str
    children: Children
    poll: bool = False
    create_first: bool = False
    seen: dict[str, Any] | None = None

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.body["metadata"])


@dataclass(frozen=True)
class Advanced:
    """What a runtime's step left: the next status, the trainer's control-plane URL (None: not reachable, or
    not asked), and the resourceVersion of the RayJob the status was derived from (runtime KubeRay)."""

    status: dict[str, Any]
    url: str | None = None
    derived_from: str | None = None


class Runtime(Protocol):
    """Where the trainer runs."""

    kind: RuntimeKind
    stops_on_delete: bool  # a deleted job waits (a finalizer) until the runtime has stopped its trainer

    def advance(self, step: Step) -> Advanced:
        """Make what is missing, move the trainer's lifecycle along to the spec, and derive the next status."""
        ...

    def trainer_url(self, ops: Operator, body: Mapping[str, Any]) -> str | None:
        """The control-plane URL of a Running job's trainer (None: the operator does not reach it)."""
        ...

    def polls(self, phase: str | None, settings: Settings) -> bool:
        """Whether the poll loop must look at a job in `phase` (not a finished one) again: only polling sees what
        changes outside Kubernetes."""
        ...
