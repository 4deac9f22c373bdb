"""The trainer config: one typed source shared with the operator's API. Imports no torch."""

from kora_trainer.config.load import ConfigError, check, load_config, read_hf_config
from kora_trainer.config.rules import (
    NO_SYNC_MODE_WARNING,
    SPEC_RULES,
    AdapterOrigin,
    Problem,
    adapter_problems,
    model_problems,
    spec_problems,
    start_adapter_problems,
)
from kora_trainer.config.sections import (
    MEGATRON_TO_HF,
    MEGATRON_TO_SGLANG,
    AlgorithmSpec,
    CheckpointSpec,
    DataSpec,
    DeploymentMode,
    DeploymentSpec,
    LoRASpec,
    ModelSpec,
    MultiLoRASpec,
    ParallelismSpec,
    RolloutSpec,
    Scope,
    SyncMode,
    SyncSpec,
    TargetModule,
)
from kora_trainer.config.trainer import Backend, TrainerConfig

__all__ = [
    "MEGATRON_TO_HF", "MEGATRON_TO_SGLANG", "NO_SYNC_MODE_WARNING", "SPEC_RULES",
    "AdapterOrigin", "AlgorithmSpec", "Backend", "CheckpointSpec", "ConfigError", "DataSpec", "DeploymentMode",
    "DeploymentSpec", "LoRASpec", "ModelSpec", "MultiLoRASpec", "ParallelismSpec", "Problem",
    "RolloutSpec", "Scope", "SyncMode", "SyncSpec", "TargetModule", "TrainerConfig",
    "adapter_problems", "check", "load_config", "model_problems", "read_hf_config", "spec_problems",
    "start_adapter_problems",
]
