"""Which nn.Linear modules get an adapter: Megatron-style target names through MEGATRON_TO_HF, then scope.

A bare leaf name (`q_proj`) would match the vision tower of a VL model as well as the language
backbone, so the choice is made on full module paths: `scope` keeps every match (all), drops those
under a vision/audio region (language), or keeps only those (vision). This decides where adapters
are injected; the base stays frozen everywhere either way.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from kora_trainer.config import MEGATRON_TO_HF, Scope, TargetModule

# Module-path components that mark a vision / audio region (HF VL and omni models: Qwen2.5-VL `visual`,
# LLaVA `vision_tower` + `multi_modal_projector`, Qwen2.5-Omni `audio_tower`, Gemma3 `vision_model`, ...).
NON_LANGUAGE_PARTS = frozenset({
    "visual", "vision_tower", "vision_model", "vision_encoder", "vision", "multi_modal_projector",
    "mm_projector", "audio", "audio_tower", "audio_model", "audio_encoder", "image_encoder",
})


def hf_leaf_names(target_modules: Iterable[TargetModule | str]) -> list[str]:
    out: list[str] = []
    for t in target_modules:
        for leaf in MEGATRON_TO_HF[TargetModule(t)]:
            if leaf not in out:
                out.append(leaf)
    return out


def in_non_language_region(module_name: str) -> bool:
    return any(part in NON_LANGUAGE_PARTS for part in module_name.split("."))


def select_targets(model: nn.Module, target_modules: Iterable[TargetModule | str],
                   scope: Scope | str = Scope.ALL) -> list[str]:
    """Full names of the nn.Linear modules to wrap, in model order."""
    leaves = set(hf_leaf_names(target_modules))
    scope = Scope(scope)
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] not in leaves:
            continue
        other_region = in_non_language_region(name)
        if (scope is Scope.LANGUAGE and other_region) or (scope is Scope.VISION and not other_region):
            continue
        chosen.append(name)
    return chosen
