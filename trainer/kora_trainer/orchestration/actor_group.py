"""The trainer's ranks as one object the driver talks to: one Ray actor per rank (`workers.TrainWorker`), every
call made on every rank at once (a step, a sync and a resume are collectives over the ranks' process group), and
what only one replica needs (checkpoints, the export: data-parallel ranks hold the same adapter) on rank 0."""

from __future__ import annotations

from typing import Any

from kora_trainer.backends.grpo_step import StepMetrics
from kora_trainer.sync.sender import SyncReport
from kora_trainer.sync.transport import SyncError


class TrainGroup:
    def __init__(self, actors: list[Any]):
        self.actors = actors  # rank order

    @property
    def world(self) -> int:
        return len(self.actors)

    def all(self, method: str, *args: Any) -> list[Any]:
        """`method` on every rank at once; every rank's answer, in rank order."""
        import ray

        return list(ray.get([getattr(a, method).remote(*args) for a in self.actors]))

    def first(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actors[0], method).remote(*args))

    def train_step(self, batch: Any) -> StepMetrics:
        """Every rank trains on its share of `batch` (a Ray object each rank reads); the metrics are the group's."""
        metrics: StepMetrics = self.all("train_step", batch)[0]
        return metrics

    def sync(self) -> SyncReport:
        """Every rank takes part (the delta-skip decision is collective); the ranks that pushed must have pushed
        the same policy (Colocate: each rank feeds its own engines)."""
        reports: list[SyncReport] = self.all("sync")
        pushed = {r.checksum for r in reports if r.pushed and r.checksum is not None}
        if len(pushed) > 1:
            raise SyncError(f"the trainer ranks pushed {len(pushed)} different policies: {sorted(pushed)}")
        if len({r.pushed for r in reports}) > 1:
            raise SyncError("the trainer ranks disagreed on delta-skip (one pushed, another skipped)")
        feeding = [r for r in reports if r.transport not in ("none", "follower")]
        return feeding[0] if feeding else reports[0]
