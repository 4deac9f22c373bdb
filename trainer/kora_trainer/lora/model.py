"""LoRA on an HF model: inject, freeze the base, switch the adapter off, export, fold.

Three views of the same policy leave this module, each under the names its consumer expects:
- `adapter_tensors`: the adapter under HF-PEFT names (`base_model.model.<module>.lora_A.weight`), what
  `peft.PeftModel`, SGLang's LoRA loader and kora's engine read (Adapter / EngineMerge modes);
- `folded_state`: the whole model with every adapter folded in, under HF state-dict names
  (`model.layers.0.self_attn.q_proj.weight`) — Merge mode;
- `base_state`: the frozen base under HF names, adapters left out — Adapter mode's first push.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from kora_trainer.config import LoRASpec, Scope
from kora_trainer.lora.layer import LoRALinear
from kora_trainer.lora.targets import in_non_language_region, select_targets

PEFT_PREFIX = "base_model.model."
Named = tuple[str, torch.Tensor]


def apply_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Wrap the selected Linear layers in place; freeze everything but the adapters. Returns module names."""
    names = select_targets(model, spec.target_modules, spec.scope)
    if not names:
        raise ValueError(f"lora.targetModules {[str(t) for t in spec.target_modules]} with scope {spec.scope} "
                         "matched no Linear layer of this model")
    unmatched = [str(t) for t in spec.target_modules if not select_targets(model, [t], spec.scope)]
    if unmatched:  # silently training less than asked for is worse than refusing
        raise ValueError(f"lora.targetModules {unmatched} matched no Linear layer of this model (scope {spec.scope})"
                         f"{_fused_hint(model)}; remove them from lora.targetModules")
    model.requires_grad_(False)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, leaf)
        wrapper = LoRALinear(base, spec.rank, spec.alpha, spec.dropout)
        wrapper.train(base.training)  # a new module starts in training mode; keep the model's mode
        setattr(parent, leaf, wrapper)
    for p in adapter_parameters(model):
        p.requires_grad_(True)
    return names


def _fused_hint(model: nn.Module) -> str:
    """Why an MLP / router target can miss: transformers 5 keeps MoE experts (and routers) as bare parameters."""
    fused = sorted({type(m).__name__ for m in model.modules()
                    if any(p.dim() == 3 for p in m.parameters(recurse=False))})
    if not fused:
        return ""
    return (f": this model's experts are fused 3-D parameters ({', '.join(fused)}), not Linear layers, and the "
            "torch backend does not put LoRA on them or on the router")


# The walks below take the wrapper class, so the Megatron backend's TP-aware wrappers reuse them
# (backends/megatron/lora.py); both kinds expose lora_A / lora_B / enabled.
def lora_modules(model: nn.Module, kind: type[nn.Module] = LoRALinear) -> dict[str, Any]:
    return {name: m for name, m in model.named_modules() if isinstance(m, kind)}


def adapter_parameters(model: nn.Module, kind: type[nn.Module] = LoRALinear) -> list[nn.Parameter]:
    return [p for m in lora_modules(model, kind).values() for p in (m.lora_A.weight, m.lora_B.weight)]


def check_only_adapters_trainable(model: nn.Module, kind: type[nn.Module] = LoRALinear) -> None:
    """SPEC rule 8's runtime half: a LoRA-only checkpoint must hold every trainable parameter."""
    adapter_ids = {id(p) for p in adapter_parameters(model, kind)}
    extra = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in adapter_ids]
    if extra:
        raise ValueError(f"trainable parameters that are not LoRA parameters: {extra[:5]}")


@contextmanager
def adapter_disabled(model: nn.Module, kind: type[nn.Module] = LoRALinear) -> Iterator[None]:
    """The base policy (KL reference) from the same weights: no second model copy."""
    modules = list(lora_modules(model, kind).values())
    before = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m, was in zip(modules, before, strict=True):
            m.enabled = was


def hf_name(param_name: str) -> str:
    """'...q_proj.base_layer.weight' -> '...q_proj.weight' (the checkpoint's own name)."""
    return param_name.replace(".base_layer.", ".")


def adapter_pairs(model: nn.Module) -> list[tuple[Named, Named]]:
    """[(A, B)] per adapted module under HF-PEFT names; A [r, in], B [out, r] (detached, live storage)."""
    return [((f"{PEFT_PREFIX}{name}.lora_A.weight", m.lora_A.weight.detach()),
             (f"{PEFT_PREFIX}{name}.lora_B.weight", m.lora_B.weight.detach()))
            for name, m in lora_modules(model).items()]


def adapter_tensors(model: nn.Module) -> list[Named]:
    return [t for pair in adapter_pairs(model) for t in pair]


def base_state(model: nn.Module) -> Iterator[Named]:
    """Every base parameter under its HF name, adapters left out (tied weights once)."""
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        yield hf_name(name), p.detach()


def folded_state(model: nn.Module) -> Iterator[Named]:
    """The merged model under HF names: adapted weights are W + s·B·A (fp32, rounded once), others as is.

    Yields one tensor at a time so a caller that buckets never holds more than a bucket of folded copies.
    """
    wrapped = {f"{name}.base_layer.weight": m for name, m in lora_modules(model).items()}
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        m = wrapped.get(name)
        yield hf_name(name), (m.folded_weight() if m is not None and m.enabled else p.detach())


def peft_config_dict(model: nn.Module, spec: LoRASpec, base_model_path: str | None) -> dict[str, Any]:
    """adapter_config.json contents that `peft.LoraConfig` (and SGLang's loader) accept.

    target_modules are leaf names when they match exactly the wrapped set; with a scope that
    excludes part of the model (a vision tower) they must be full paths, or PEFT would re-target it.
    """
    wrapped = list(lora_modules(model))
    leaves = sorted({n.rsplit(".", 1)[-1] for n in wrapped})
    if spec.scope is not Scope.ALL and any(in_non_language_region(n) for n, _ in model.named_modules()):
        targets: list[str] = wrapped
    else:
        targets = leaves
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "target_modules": targets,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        "inference_mode": True,
    }
