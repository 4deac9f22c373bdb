"""The diffusion adapter exported as diffusers' own LoRA file: `<checkpoint.path>/lora_adapter/` with
`pytorch_lora_weights.safetensors`, which `pipe.load_lora_weights(dir)` (an SD3 pipeline) and
`transformer.load_lora_adapter(dir)` load as is.

Written by diffusers itself (`SD3LoraLoaderMixin.save_lora_weights`): the tensors under the transformer's module
names with the `transformer.` prefix (`transformer.transformer_blocks.0.attn.to_q.lora_A.weight`), and the adapter's
`peft.LoraConfig` (rank, alpha, target modules) as the file's metadata, so the loader rebuilds the same scaling.
Beside it `kora_lora_meta.json` (the step, the base, the seed), as the language-model export has. Atomic: a temp dir
swapped into place (checkpoint/swap_dir.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kora_trainer.checkpoint.peft_adapter import DIFFUSERS_WEIGHTS
from kora_trainer.checkpoint.peft_export import EXPORT_DIR, META_FILE, PEFT_PREFIX
from kora_trainer.checkpoint.swap_dir import swapped_in
from kora_trainer.lora.model import adapter_tensors

WEIGHT_NAME = DIFFUSERS_WEIGHTS


def lora_layers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter under the transformer's module names (`transformer_blocks.0.attn.to_q.lora_A.weight`)."""
    return {name.removeprefix(PEFT_PREFIX): t.detach().contiguous().cpu() for name, t in adapter_tensors(model)}


def lora_config(rank: int, alpha: float, targets: Sequence[str], init: str) -> dict[str, Any]:
    """The peft.LoraConfig diffusers stores beside the weights (what `save_lora_adapter` writes)."""
    from peft import LoraConfig  # noqa: PLC0415 - the diffusion stack (peft) loads on use

    # peft types lora_alpha as int and init as its literals; the config keeps the float alpha as given
    made: Any = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),  # type: ignore[arg-type]
                           init_lora_weights="gaussian" if init == "gaussian" else True)
    config: dict[str, Any] = made.to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def export_diffusers_lora(root: Path, model: nn.Module, config: Mapping[str, Any], meta: Mapping[str, Any]) -> Path:
    """Write `root/lora_adapter/` (see the module docstring); return it."""
    from diffusers.loaders.lora_pipeline import SD3LoraLoaderMixin  # noqa: PLC0415 - the diffusion stack (diffusers) loads on use

    with swapped_in(Path(root), EXPORT_DIR) as tmp:
        layers: dict[str, nn.Module | torch.Tensor] = dict(lora_layers(model))
        SD3LoraLoaderMixin.save_lora_weights(tmp, transformer_lora_layers=layers, weight_name=WEIGHT_NAME,
                                             transformer_lora_adapter_metadata=dict(config))
        (tmp / META_FILE).write_text(json.dumps(dict(meta), indent=2) + "\n")
    return Path(root) / EXPORT_DIR
