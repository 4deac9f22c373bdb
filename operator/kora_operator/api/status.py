"""LoRATrainingJob status. The operator is its only writer (through the /status subresource)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from kora_trainer.config.base import CamelModel
from kora_trainer.config.sections import SyncMode


class Phase(StrEnum):
    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class Condition(CamelModel):
    """A metav1.Condition: one aspect of the job's state and when it last changed."""

    type: Annotated[str, Field(max_length=316)]
    """Validated, ClusterReady, Training, WeightsSynced, Checkpointed, Complete or Failed."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The .metadata.generation this condition was set from."""
    last_transition_time: datetime
    """When status last changed."""
    reason: Annotated[str, Field(min_length=1, max_length=1024)]
    """CamelCase reason for the last transition."""
    message: Annotated[str, Field(max_length=32768)] = ""
    """Human-readable details."""


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


class CheckpointProgress(CamelModel):
    """The last checkpoint written."""

    path: str | None = None
    """Checkpoint directory."""
    step: Annotated[int, Field(ge=0)] | None = None
    """Step it holds."""


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


class LoRATrainingJobStatus(CamelModel):
    """Observed state of a LoRATrainingJob."""

    phase: Phase | None = None
    """Pending, Provisioning, Running, Suspended, Succeeded or Failed (derived from conditions)."""
    sync_mode: SyncMode | None = None
    """The weight-sync mode in effect (spec.lora.syncMode, or Merge when unset)."""
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Validated, ClusterReady, Training, WeightsSynced, Checkpointed, Complete, Failed."""
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The .metadata.generation the operator last acted on."""
    ray_job_name: str | None = None
    """The RayJob (runtime KubeRay) or Ray job submission id (runtime Ray)."""
    ray_cluster_name: str | None = None
    """The Ray cluster running the job."""
    dashboard_url: str | None = Field(default=None, alias="dashboardURL")
    """Ray dashboard address (as KubeRay reports it in the RayJob's status.dashboardURL)."""
    start_time: datetime | None = None
    """When the trainer started."""
    completion_time: datetime | None = None
    """When the job succeeded or failed."""
    restarts: Annotated[int, Field(ge=0)] = 0
    """Times the trainer was resubmitted after a failure (resuming from its last checkpoint)."""
    progress: Progress | None = None
    """Step, reward, last sync and last checkpoint."""
