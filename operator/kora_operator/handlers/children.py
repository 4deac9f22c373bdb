"""A job's children in Kubernetes: created if absent, one Event for what one reconcile made (DESIGN habit 4).

The runtime (runtimes/) decides when to make them and what to do with the RayJob among them (KubeRay has one,
Ray none); this is the making, the same for both (runtimes.base.Children).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kopf

from kora_operator.api.job import LoRATrainingJob
from kora_operator.builders.children import build_children
from kora_operator.builders.secret import new_token
from kora_operator.handlers.context import Context
from kora_operator.kube import ApiException, Kube
from kora_operator.metrics import CHILDREN_CREATED
from kora_operator.reasons import CREATED, FAILED_TO_CREATE, EventType, Reason
from kora_operator.runtimes.kuberay import RETRY_DELAY, align_ray_job


@dataclass(frozen=True)
class JobChildren:
    """The children of the job `body` (parsed: `job`), and what the operator remembers of them (ctx.children:
    all seen within its recheck time; None: nothing is remembered)."""

    ctx: Context
    body: dict[str, Any]
    job: LoRATrainingJob

    @property
    def uid(self) -> str:
        return str(self.body["metadata"]["uid"])

    def known(self) -> bool:
        return self.ctx.children is not None and self.ctx.children.known(self.uid)

    def remember(self) -> None:
        if self.ctx.children is not None:
            self.ctx.children.remember(self.uid)

    def forget(self) -> None:
        if self.ctx.children is not None:
            self.ctx.children.forget(self.uid)

    def create(self, create_first: bool = False) -> dict[str, Any] | None:
        """Create what is missing; return the RayJob as it stands (None when the job has none), aligned to the spec.

        The Secrets are never read: create answers 409 when one exists, which is all we need to know, and
        so the operator's account may create Secrets but needs no right to read any. The token is
        derived from the job's uid (tokens.py): the operator can compute it again whenever it polls. The
        engines' admin key is random: a fresh one is offered each time, and only the first create keeps one,
        so a job's key never changes while its Secret lives. `create_first` (a job being created): each child is
        created without a GET before; the RayJob is read only if its create answers 409.
        """
        kube = self.ctx.kube
        ray: dict[str, Any] | None = None
        made: list[tuple[str, str]] = []  # (kind, name) of what this reconcile created: one Event says it
        for child in build_children(self.job, token=self.ctx.tokens.for_job(self.uid), engine_key=new_token(),
                                    peers=self.ctx.settings.network_peers()):
            existing = self._create_one(child, create_first, made)
            if child["kind"] == "RayJob":
                ray = existing
                if ray is not None:
                    align_ray_job(kube, self.body, self.job, ray)
        created_event(kube, self.body, made)
        return ray

    def _create_one(self, child: dict[str, Any], create_first: bool,
                    made: list[tuple[str, str]]) -> dict[str, Any] | None:
        """The child as it stands after creating it if it was missing (None: not read, or a Secret)."""
        kube, kind = self.ctx.kube, child["kind"]
        existing = None if kind == "Secret" or create_first else kube.get_child(child)
        if existing is not None:
            return existing
        try:
            created = kube.create_child(child)
        except ApiException as e:
            created_event(kube, self.body, made)
            kube.event(self.body, EventType.WARNING, FAILED_TO_CREATE[kind],
                       f"creating {kind} {child['metadata']['name']} failed: {e.status} {e.reason}")
            raise kopf.TemporaryError(f"creating {kind}: {e.status} {e.reason}", delay=RETRY_DELAY) from e
        if created is not None:  # None: it was there already (a Secret, a create-first, or a race)
            CHILDREN_CREATED.labels(kind).inc()
            made.append((kind, child["metadata"]["name"]))
            return created
        if kind == "RayJob":  # the others' existence is all that matters
            return kube.get_child(child)
        return None


def created_event(kube: Kube, body: dict[str, Any], made: list[tuple[str, str]]) -> None:
    """One Event for the children one reconcile made: Created<Kind> for one (a child re-made after a delete),
    CreatedChildren naming each for several (a new job's five: one API write, not five, the same words)."""
    if not made:
        return
    reason = CREATED[made[0][0]] if len(made) == 1 else Reason.CREATED_CHILDREN
    kube.event(body, EventType.NORMAL, reason, "created " + ", ".join(f"{kind} {name}" for kind, name in made))
