"""TrainerConfig: the job as the trainer sees it (the rendered `job.yaml` in the ConfigMap)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from kora_trainer.config.base import CamelModel
from kora_trainer.config.sections import (
    AlgorithmSpec,
    CheckpointSpec,
    DataSpec,
    DeploymentSpec,
    DiffusionSpec,
    LoRASpec,
    ModelSpec,
    MultiLoRASpec,
    ParallelismSpec,
    RolloutSpec,
    SyncSpec,
    TrackingSpec,
)


class Backend(StrEnum):
    AUTO = "auto"
    TORCH = "torch"
    MEGATRON = "megatron"


class TrainerConfig(CamelModel):
    """A LoRA RL training job: model, adapter, algorithm, data, rollout and sync."""

    model: ModelSpec
    """The base model (frozen during training)."""
    lora: LoRASpec
    """The LoRA adapter and its weight-sync mode."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """Algorithm (GRPO), learning rate, steps and batch shape."""
    data: DataSpec
    """Prompt dataset and reward."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """Rollout engines."""
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    """Actor parallelism (Megatron terms)."""
    deployment: DeploymentSpec = Field(default_factory=DeploymentSpec)
    """Colocated or disaggregated training and rollout; sync or fully-async."""
    sync: SyncSpec = Field(default_factory=SyncSpec)
    """Weight-sync bucket size, delta-skip threshold and fast path."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpoints and adapter export."""
    multi_lora: MultiLoRASpec = Field(default_factory=MultiLoRASpec)
    """Multi-adapter service settings (LoRAAdapter objects)."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """TensorBoard and W&B logging of the per-step metrics."""
    diffusion: DiffusionSpec | None = None
    """Set: the job trains a diffusion model's adapter with Flow-GRPO (model.path a diffusers checkpoint)."""
    backend: Backend = Backend.AUTO
    """Training backend: torch (HF models; CPU and small GPU runs), megatron (megatron-core; GPU),
    or auto (megatron when a GPU is present and the model is large, torch otherwise)."""
