"""The trainer's control-plane `/status` payload: one model for the trainer that serves it
(kora_trainer/control_plane.py) and the operator that polls it (kora_operator/progress.py); and what a
status says alike on both sides: its timestamps and its messages.

`TrainerStatus` is the whole answer (camelCase JSON). Its `Progress` part is what the operator copies
into a LoRATrainingJob's status.progress (the CRD schema embeds it: kora_operator/api/status.py); the
rest says how the run stands. Imports nothing heavy: the operator reads it too.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, Field

from kora_trainer.config.base import CamelModel
from kora_trainer.config.sections import SyncMode

# RFC 3339 in UTC to the second, as Kubernetes writes its own times (metav1.Time)
RFC3339 = "%Y-%m-%dT%H:%M:%SZ"
# Events are cut below 1 KiB; conditions, failure summaries and the trainer's /status message use the
# same cap so they read alike
MAX_MESSAGE = 1000


def rfc3339(when: datetime | None = None) -> str:
    """`when` (default: now) as RFC 3339 in UTC, e.g. 2026-11-30T10:00:00Z."""
    return (when or datetime.now(UTC)).astimezone(UTC).strftime(RFC3339)


class SyncProgress(CamelModel):
    """The last weight sync to the rollout engines; compare adapterVersion with step for staleness."""

    mode: SyncMode | None = None
    """Merge, Adapter or EngineMerge."""
    bytes: Annotated[int, Field(ge=0)] | None = None
    """Bytes pushed."""
    milliseconds: Annotated[float, Field(ge=0)] | None = None
    """Wall time of the push, trainer step done to engines serving it."""
    adapter_version: Annotated[int, Field(ge=0)] | None = None
    """Policy version (trainer step) the engines now serve."""
    checksum: str | None = None
    """Checksum of the pushed weights, as computed by the trainer."""
    time: datetime | None = None
    """When the sync finished."""


class ServingCheckProgress(CamelModel):
    """The serving check of the last on-policy step: the engines' log-probs of the sampled tokens against the
    trainer's own for the policy version the engines claim to serve (0 up to kernel noise when they serve it)."""

    logp_gap_max: Annotated[float, Field(ge=0)] | None = None
    """Largest |trainer - engine| log-prob over the step's sampled tokens."""
    logp_gap_mean: Annotated[float, Field(ge=0)] | None = None
    """Mean |trainer - engine| log-prob over the step's sampled tokens."""
    version: Annotated[int, Field(ge=0)] | None = None
    """The policy version (trainer step) the engines claimed to serve for those rollouts."""
    step: Annotated[int, Field(ge=0)] | None = None
    """The trainer step that measured it."""
    threshold: Annotated[float, Field(gt=0)] | None = None
    """sync.servedLogpGapMax: a larger logpGapMax is a bad step."""
    bad_steps: Annotated[int, Field(ge=0)] | None = None
    """Consecutive bad steps so far (the run stops at sync.servedBadStepsToFail)."""
    adapter: str | None = None
    """Multi-adapter jobs: the adapter this check is of (version and step are its own); the job's status shows the
    adapter with the most bad steps in a row (then the largest gap) of the last train call."""


class CheckpointProgress(CamelModel):
    """The last checkpoint written."""

    path: str | None = None
    """Checkpoint directory."""
    step: Annotated[int, Field(ge=0)] | None = None
    """Step it holds."""
    time: datetime | None = None
    """When it was written."""


class Progress(CamelModel):
    """Training progress, read from the trainer's control-plane API."""

    step: Annotated[int, Field(ge=0)] | None = None
    """Optimizer steps done."""
    total_steps: Annotated[int, Field(ge=0)] | None = None
    """Steps the job will run."""
    reward_mean: float | None = None
    """Mean training reward of the last step."""
    last_sync: SyncProgress | None = None
    """The last weight sync."""
    last_checkpoint: CheckpointProgress | None = None
    """The last checkpoint."""
    serving_check: ServingCheckProgress | None = None
    """The serving check of the last on-policy step (PolicyServed False above its threshold)."""
    active_adapters: Annotated[int, Field(ge=0)] | None = None
    """Multi-adapter jobs: adapters holding a slot (registered and not yet finished)."""
    seconds_per_step: Annotated[float, Field(ge=0)] | None = None
    """Wall seconds per step, measured over the last steps this attempt ran (the ETA's rate)."""
    estimated_remaining_seconds: Annotated[int, Field(ge=0)] | None = None
    """Seconds until the last step at secondsPerStep: (totalSteps - step) x secondsPerStep; 0 once done."""
    eta: str | None = None
    """estimatedRemainingSeconds for people, e.g. 1h02m or 4m10s (the ETA column of kubectl get ltj -o wide)."""


class TrainerPhase(StrEnum):
    STARTING = "Starting"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


FINAL_PHASES = frozenset({TrainerPhase.SUCCEEDED, TrainerPhase.FAILED})


def _capped(message: str) -> str:
    return message[:MAX_MESSAGE]


class TrainerStatus(Progress):
    """The whole GET /status answer of a trainer's control plane: its progress, and how the run stands."""

    phase: TrainerPhase = TrainerPhase.STARTING
    """Starting until the first step runs (a resumed run has not restored its checkpoint yet, so its step
    may read lower than the last attempt's), then Running, then Succeeded or Failed."""
    sync_mode: SyncMode | None = None
    """The weight-sync mode in effect."""
    message: Annotated[str, AfterValidator(_capped)] = ""
    """What ended a failed run, cut to MAX_MESSAGE characters; empty otherwise."""
    synced_step: Annotated[int, Field(ge=0)] | None = None
    """The last step whose policy the engines serve, pushed or skipped as unchanged within
    sync.deltaSkipThreshold (a skip moves no bytes and leaves lastSync.adapterVersion behind)."""
    resumed_from_step: Annotated[int, Field(ge=0)] | None = None
    """The checkpoint step this run resumed from; null for a fresh start."""
