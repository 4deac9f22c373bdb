"""Which nn.Linear modules get an adapter: Megatron-style target names through MEGATRON_TO_HF, then scope.
Where transformers keeps a target as a bare parameter instead (MoE experts and routers of transformers 5),
`select_param_targets` names the (module, parameter) pairs that `params.LoRAParam` wraps.

A bare leaf name (`q_proj`) would match the vision tower of a VL model as well as the language
backbone, so the choice is made on full module paths: `scope` keeps every match (all), drops those
under a vision/audio region (language), or keeps only those (vision). This decides where adapters
are injected; the base stays frozen everywhere either way.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from kora_trainer.config import MEGATRON_TO_HF, VISION_MEGATRON_TO_HF, Scope, TargetModule

# Module-path components that mark a vision / audio region (HF VL and omni models: Qwen2.5-VL `visual`,
# LLaVA `vision_tower` + `multi_modal_projector`, Qwen2.5-Omni `audio_tower`, Gemma3 `vision_model`, ...).
NON_LANGUAGE_PARTS = frozenset({
    "visual", "vision_tower", "vision_model", "vision_encoder", "vision", "multi_modal_projector",
    "mm_projector", "audio", "audio_tower", "audio_model", "audio_encoder", "image_encoder",
})


def hf_leaf_names(target_modules: Iterable[TargetModule | str], vision: bool = False) -> list[str]:
    """The HF leaf names the targets wrap; `vision`: inside a vision tower, where they also name its own leaves
    (VISION_MEGATRON_TO_HF)."""
    out: list[str] = []
    for t in target_modules:
        extra = VISION_MEGATRON_TO_HF.get(TargetModule(t), ()) if vision else ()
        for leaf in (*MEGATRON_TO_HF[TargetModule(t)], *extra):
            if leaf not in out:
                out.append(leaf)
    return out


def in_non_language_region(module_name: str) -> bool:
    return any(part in NON_LANGUAGE_PARTS for part in module_name.split("."))


def select_targets(model: nn.Module, target_modules: Iterable[TargetModule | str],
                   scope: Scope | str = Scope.ALL) -> list[str]:
    """Full names of the nn.Linear modules to wrap, in model order."""
    targets = list(target_modules)
    leaves, vision_leaves = set(hf_leaf_names(targets)), set(hf_leaf_names(targets, vision=True))
    scope = Scope(scope)
    chosen = []
    for name, module in model.named_modules():
        other_region = in_non_language_region(name)
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] not in (vision_leaves if other_region
                                                                                else leaves):
            continue
        if (scope is Scope.LANGUAGE and other_region) or (scope is Scope.VISION and not other_region):
            continue
        chosen.append(name)
    return chosen


# Megatron target -> (module leaf, parameter, its dim) where transformers 5 holds it as a bare parameter: the
# fused experts ([E, out, in]; gate_up before down, the order PEFT nests its wrappers in) and the MoE router.
PARAM_TARGETS: dict[TargetModule, tuple[str, str, int]] = {
    TargetModule.LINEAR_FC1: ("experts", "gate_up_proj", 3),
    TargetModule.LINEAR_FC2: ("experts", "down_proj", 3),
    TargetModule.ROUTER: ("gate", "weight", 2),
}


def select_param_targets(model: nn.Module, target_modules: Iterable[TargetModule | str],
                         scope: Scope | str = Scope.ALL) -> list[tuple[str, str]]:
    """(module path, parameter name) of every bare parameter to wrap, in model order (gate_up before down)."""
    wanted = [PARAM_TARGETS[TargetModule(t)] for t in target_modules if TargetModule(t) in PARAM_TARGETS]
    scope = Scope(scope)
    chosen = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            continue
        other_region = in_non_language_region(name)
        if (scope is Scope.LANGUAGE and other_region) or (scope is Scope.VISION and not other_region):
            continue
        own = dict(module.named_parameters(recurse=False))
        for leaf, param, dim in sorted(wanted, key=lambda w: list(PARAM_TARGETS.values()).index(w)):
            if name.rsplit(".", 1)[-1] == leaf and param in own and own[param].dim() == dim:
                chosen.append((name, param))
    return chosen
