"""HF-PEFT export: `lora_adapter/` that `peft.PeftModel.from_pretrained(base, dir)` loads as is.

Written beside the resumable checkpoint, never into it (SPEC rule 8: no HF export in the same
save). Atomic like the checkpoints: a temp dir renamed into place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kora_trainer.checkpoint.swap_dir import swapped_in

EXPORT_DIR = "lora_adapter"
META_FILE = "kora_lora_meta.json"
PEFT_PREFIX = "base_model.model."


def adapter_config(*, base_model: str, rank: int, alpha: float, target_modules: list[str],
                   dropout: float = 0.0, target_parameters: list[str] | None = None) -> dict[str, Any]:
    """The adapter_config.json peft expects for a plain LoRA on a causal LM.

    `target_parameters` (peft's ParamWrapper: fused MoE experts, bare router weights) are kept in the order
    given. peft refuses lora_dropout != 0 on a ParamWrapper; dropout only regularises training and the exported
    policy is the same without it, so such a config says 0.
    """
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": sorted(set(target_modules)),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "inference_mode": True, "modules_to_save": None, "init_lora_weights": True,
    }
    if target_parameters:
        config.update(target_parameters=list(dict.fromkeys(target_parameters)), lora_dropout=0.0)
    return config


def export_peft(checkpoint_root: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                meta: Mapping[str, Any]) -> Path:
    """Write `checkpoint_root/lora_adapter/`. Tensor names must be HF-PEFT names
    (`base_model.model.<module>.lora_A.weight`)."""
    bad = [k for k in tensors if not k.startswith(PEFT_PREFIX) or not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if bad:
        raise ValueError(f"not HF-PEFT adapter names: {bad[:3]}")
    with swapped_in(Path(checkpoint_root), EXPORT_DIR) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                  str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
        (tmp / META_FILE).write_text(json.dumps(dict(meta), indent=2) + "\n")
    return Path(checkpoint_root) / EXPORT_DIR
