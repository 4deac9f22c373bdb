"""LoRATrainingJob status. The operator is its only writer (through the /status subresource)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from kora_trainer.config.base import CamelModel
from kora_trainer.config.sections import SyncMode

# status.progress is the trainer's own /status model (its Progress part): one definition for the trainer
# that serves it, the operator that copies it, and the CRD schema generated from it
from kora_trainer.config.status import CheckpointProgress, Progress, SyncProgress

__all__ = ["TERMINAL", "CheckpointProgress", "Condition", "LoRATrainingJobStatus", "Phase", "Progress", "SyncProgress"]


class Phase(StrEnum):
    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)  # a job in one of these is history: nothing moves it again


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
