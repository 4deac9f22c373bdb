"""LoRA for HF models (torch backend): injection by Megatron-style target names, export, folding."""

from kora_trainer.lora.layer import LoRALinear
from kora_trainer.lora.model import (
    PEFT_PREFIX,
    adapter_disabled,
    adapter_pairs,
    adapter_parameters,
    adapter_tensors,
    apply_lora,
    base_state,
    check_only_adapters_trainable,
    folded_state,
    hf_name,
    lora_modules,
    peft_config_dict,
)
from kora_trainer.lora.targets import hf_leaf_names, select_targets

__all__ = [
    "PEFT_PREFIX", "LoRALinear", "adapter_disabled", "adapter_pairs", "adapter_parameters", "adapter_tensors",
    "apply_lora", "base_state", "check_only_adapters_trainable", "folded_state", "hf_leaf_names", "hf_name",
    "lora_modules", "peft_config_dict", "select_targets",
]
