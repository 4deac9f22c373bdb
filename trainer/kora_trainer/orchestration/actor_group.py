"""The trainer's ranks as one object the driver talks to: one Ray actor per rank (`workers.TrainWorker`), every
call made on every rank at once (a step, a sync, a resume, a checkpoint and the export are collectives over the
ranks' process group: tensor-parallel shards are gathered), and what is written only once (checkpoints, the
export: data-parallel ranks hold the same adapter) written by rank 0 (`written`)."""

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
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        return list(ray.get([getattr(a, method).remote(*args) for a in self.actors]))

    def first(self, method: str, *args: Any) -> Any:
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        return ray.get(getattr(self.actors[0], method).remote(*args))

    def written(self, method: str, *args: Any) -> Any:
        """`method` on every rank at once; the answer of the rank that wrote (the others answer None)."""
        answers = [a for a in self.all(method, *args) if a is not None]
        if len(answers) != 1:
            raise RuntimeError(f"{method}: {len(answers)} trainer ranks wrote, not one (checkpoint_writer)")
        return answers[0]

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
