"""LoRAAdapter: one adapter of a multi-adapter LoRATrainingJob (multiLora.maxAdapters > 0)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kora_operator.api.status import Condition
from kora_trainer.config.adapter_runs import AdapterPhase
from kora_trainer.config.base import CamelModel
from kora_trainer.config.sections import AdapterRunConfig
from kora_trainer.config.status import CheckpointProgress, SyncProgress


class LoRAAdapterSpec(AdapterRunConfig):
    """An adapter trained and served by a multi-adapter LoRATrainingJob in the same namespace: the trainer's
    AdapterRunConfig (what `POST /adapter_runs` takes) and the job it joins."""

    job_name: Annotated[str, Field(min_length=1, max_length=253)] = Field(
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": "self == oldSelf", "message": "jobName is immutable: create a new LoRAAdapter"}]}
    )
    """The LoRATrainingJob (multiLora.maxAdapters > 0) that trains and serves this adapter."""

    def config(self) -> AdapterRunConfig:
        return AdapterRunConfig.model_validate(self.model_dump(exclude={"job_name"}))


class LoRAAdapterStatus(CamelModel):
    """Observed state of one adapter, from its job's trainer (`GET /adapter_runs/state`)."""

    phase: AdapterPhase | None = None
    """Pending (waiting for its job, a free slot, or the trainer to load it), Training, Retiring, Succeeded,
    Retired (deleted before its numSteps) or Failed."""
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The .metadata.generation the operator last acted on."""
    slot: Annotated[int, Field(ge=0)] | None = None
    """The trainer's adapter slot it holds (unset before registration and once it has freed it)."""
    step: Annotated[int, Field(ge=0)] | None = None
    """This adapter's optimizer steps."""
    num_steps: Annotated[int, Field(ge=0)] | None = None
    """The step it retires at (unset until the trainer has read its data, when numEpochs decides it)."""
    version: Annotated[int, Field(ge=0)] | None = None
    """Adapter version the engines serve (its step at its last push)."""
    reward_mean: float | None = None
    """Mean reward of its last step."""
    last_sync: SyncProgress | None = None
    """Its last push to the engines."""
    last_checkpoint: CheckpointProgress | None = None
    """Its last checkpoint (`<checkpoint.path>/adapters/<name>/`)."""
    export_path: str | None = None
    """Its HF-PEFT export, written when it retires."""
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Registered, Training, WeightsSynced, Complete, Failed."""


class LoRAAdapter(CamelModel):
    """One adapter of a multi-adapter LoRATrainingJob."""

    api_version: Literal["kora.dev/v1alpha1"] = "kora.dev/v1alpha1"
    """kora.dev/v1alpha1"""
    kind: Literal["LoRAAdapter"] = "LoRAAdapter"
    """LoRAAdapter"""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Standard object metadata."""
    spec: LoRAAdapterSpec
    """Desired state."""
    status: LoRAAdapterStatus | None = None
    """Observed state, written by the operator."""
