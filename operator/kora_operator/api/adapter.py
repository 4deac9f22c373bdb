"""LoRAAdapter: one adapter of a multi-adapter LoRATrainingJob (multiLora.maxAdapters > 0)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kora_operator.api.status import Condition
from kora_trainer.config.adapter_runs import AdapterPhase
from kora_trainer.config.base import CamelModel
from kora_trainer.config.sections import AdapterRunConfig


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
    """Observed state of one adapter, from the trainer's /adapter_runs/state."""

    phase: AdapterPhase | None = None
    """Pending, Training, Succeeded or Failed."""
    step: Annotated[int, Field(ge=0)] | None = None
    """This adapter's optimizer steps."""
    version: Annotated[int, Field(ge=0)] | None = None
    """Adapter version the engines serve."""
    reward_mean: float | None = None
    """Mean reward of its last step."""
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
