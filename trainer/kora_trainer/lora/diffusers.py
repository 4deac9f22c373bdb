"""LoRA on a diffusers transformer, under the module names PEFT and sglang-diffusion use.

Targets are diffusers module paths matched as PEFT matches `target_modules` (the full name, or a suffix after a
dot), so `to_out.0` means every `...attn.to_out.0`. The SD3 default is flow_grpo's list (scripts/train_sd3.py:419
@ ac4c86e8): the image stream's `to_q`, `to_k`, `to_v`, `to_out.0` and the joint blocks' text stream
`add_q_proj`, `add_k_proj`, `add_v_proj`, `to_add_out` (absent in SD3's last block, `context_pre_only`).
The layers are kora's own `lora.LoRALinear` (PEFT's layout: `base_layer`, `lora_A`, `lora_B`), so the trainer's
walks (adapter_pairs, folded_state, adapter_disabled for the KL reference) serve diffusion models unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from kora_trainer.lora.layer import LoRALinear
from kora_trainer.lora.model import adapter_parameters, lora_modules, replace_module

SD3_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
INITS = ("default", "gaussian")


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def select_diffusion_targets(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """Full names of the nn.Linear modules `targets` name, in model order; a target matching none is an error."""
    chosen = [name for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and any(_matches(name, t) for t in targets)]
    unmatched = [t for t in targets if not any(_matches(n, t) for n in chosen)]
    if unmatched:  # training less than asked for, silently, is worse than refusing
        raise ValueError(f"diffusion.targetModules {unmatched} matched no nn.Linear of this {type(model).__name__}; "
                         f"use diffusers module names such as {list(SD3_TARGETS)}")
    return chosen


def apply_diffusion_lora(model: nn.Module, rank: int, alpha: float, targets: Sequence[str] = SD3_TARGETS,
                         init: str = "gaussian") -> list[str]:
    """Wrap the target linears in place, freeze everything else; return the wrapped names.

    init "gaussian" (flow_grpo's and the seed's `--lora-init-weights gaussian`, PEFT's rule): A ~ N(0, 1/r);
    "default": PEFT's default (A kaiming-uniform). B = 0 either way, so training starts at the base policy.
    """
    if rank < 1:
        raise ValueError(f"lora.rank {rank} must be >= 1")
    if init not in INITS:
        raise ValueError(f"lora init {init!r} is not one of {list(INITS)}")
    names = select_diffusion_targets(model, targets)
    model.requires_grad_(False)
    for name in names:  # nn.ModuleList (`to_out`) takes setattr by its index name ("0") too
        replace_module(model, name, lambda base: _wrap(base, rank, alpha, init))
    for p in adapter_parameters(model):
        p.requires_grad_(True)
    return names


def _wrap(base: nn.Linear, rank: int, alpha: float, init: str) -> LoRALinear:
    wrapper = LoRALinear(base, rank, alpha)
    if init == "gaussian":
        nn.init.normal_(wrapper.lora_A.weight, std=1.0 / rank)
    return wrapper


def lora_module_names(model: nn.Module) -> list[str]:
    return list(lora_modules(model, LoRALinear))

