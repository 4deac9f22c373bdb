"""LoRAAdapter: one adapter of a multi-adapter LoRATrainingJob (multiLora.maxAdapters > 0)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field

from kora_operator.api.status import Condition
from kora_trainer.config.base import CamelModel
from kora_trainer.config.sections import DataSpec


class AdapterPhase(StrEnum):
    PENDING = "Pending"
    TRAINING = "Training"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class LoRAAdapterSpec(CamelModel):
    """An adapter trained and served by a multi-adapter LoRATrainingJob in the same namespace."""

    model_config = CamelModel.model_config | {
        "json_schema_extra": {"x-kubernetes-validations": [
            {"rule": "!(has(self.numSteps) && has(self.numEpochs))",
             "message": "numSteps and numEpochs are both set: keep one of them", "fieldPath": ".numEpochs"},
            {"rule": "self.data.rewardType != 'custom' || has(self.data.customRewardPath)",
             "message": "data.rewardType custom needs data.customRewardPath: set it to a dotted path "
                        "such as mypkg.rewards.reward", "fieldPath": ".data.customRewardPath"},
        ]}
    }

    job_name: Annotated[str, Field(min_length=1, max_length=253)] = Field(
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": "self == oldSelf", "message": "jobName is immutable: create a new LoRAAdapter"}]}
    )
    """The LoRATrainingJob (multiLora.maxAdapters > 0) that trains and serves this adapter."""
    rank: Annotated[int, Field(ge=1, le=4096)]
    """LoRA rank; at most the job's lora.rank."""
    alpha: Annotated[float, Field(gt=0)] = 32.0
    """LoRA alpha (scaling alpha/rank)."""
    lr: Annotated[float, Field(gt=0, le=1.0)] | None = None
    """Learning rate of this adapter's own optimizer; default the job's algorithm.lr."""
    rollout_batch_size: Annotated[int, Field(ge=1)] | None = None
    """Prompt groups per optimizer step of this adapter; default the job's."""
    n_samples_per_prompt: Annotated[int, Field(ge=1)] | None = None
    """Group size; default the job's. Must divide, or be a multiple of, the trainer's DP size."""
    data: DataSpec
    """This adapter's prompts and reward."""
    num_steps: Annotated[int, Field(ge=1)] | None = None
    """Stop after this many of its own optimizer steps."""
    num_epochs: Annotated[int, Field(ge=1)] | None = None
    """Or after this many passes over its data (default 1)."""


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
