"""LoRA on an HF model: inject, freeze the base, switch the adapter off, export, fold.

Three views of the same policy leave this module, each under the names its consumer expects:
- `adapter_tensors`: the adapter under HF-PEFT names (`base_model.model.<module>.lora_A.weight`), what
  `peft.PeftModel`, SGLang's LoRA loader and kora's engine read (Adapter / EngineMerge modes);
- `folded_state`: the whole model with every adapter folded in, under HF state-dict names
  (`model.layers.0.self_attn.q_proj.weight`) — Merge mode;
- `base_state`: the frozen base under HF names, adapters left out — Adapter mode's first push.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from kora_trainer.config import LoRASpec
from kora_trainer.lora.layer import LoRALinear
from kora_trainer.lora.params import LoRAParam
from kora_trainer.lora.targets import in_non_language_region, select_param_targets, select_targets

PEFT_PREFIX = "base_model.model."
_BASE_LAYERS = re.compile(r"(?:\.base_layer)+\.")
Named = tuple[str, torch.Tensor]


def apply_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Wrap the selected Linear layers (and bare MoE expert / router parameters: `params.py`) in place; freeze
    everything but the adapters. Returns the wrapped module names."""
    names = select_targets(model, spec.target_modules, spec.scope)
    params = select_param_targets(model, spec.target_modules, spec.scope)
    unmatched = [str(t) for t in spec.target_modules
                 if not select_targets(model, [t], spec.scope) and not select_param_targets(model, [t], spec.scope)]
    if unmatched:  # silently training less than asked for is worse than refusing
        raise ValueError(f"lora.targetModules {unmatched} matched no Linear layer or MoE parameter of this model "
                         f"(scope {spec.scope}); remove them from lora.targetModules")
    model.requires_grad_(False)
    for name in names:
        replace_module(model, name, lambda base: LoRALinear(base, spec.rank, spec.alpha, spec.dropout))
    for name, param in params:  # a module's second parameter wraps its first wrapper, as PEFT nests them
        replace_module(model, name, lambda base, param=param: LoRAParam(base, param, spec.rank, spec.alpha))
    for p in adapter_parameters(model):
        p.requires_grad_(True)
    return names + [name for name, _ in params]


def replace_module(model: nn.Module, name: str, wrap: Any) -> None:
    """Swap the submodule `name` for `wrap(it)`, keeping its train/eval mode (how every LoRA wrapper goes in: the
    LM layers here, the diffusers ones in lora/diffusers.py)."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    base = getattr(parent, leaf)
    wrapper = wrap(base)
    wrapper.train(base.training)  # a new module starts in training mode; keep the model's mode
    setattr(parent, leaf, wrapper)


# The walks below take the wrapper class, so the Megatron backend's TP-aware wrappers reuse them
# (backends/megatron/lora.py); both kinds expose lora_A / lora_B / enabled.
LORA_KINDS = (LoRALinear, LoRAParam)


def lora_modules(model: nn.Module, kind: Any = LORA_KINDS) -> dict[str, Any]:
    return {name: m for name, m in model.named_modules() if isinstance(m, kind)}


def adapter_parameters(model: nn.Module, kind: Any = LORA_KINDS) -> list[nn.Parameter]:
    return [p for m in lora_modules(model, kind).values() for p in (m.lora_A.weight, m.lora_B.weight)]


def check_only_adapters_trainable(model: nn.Module, kind: Any = LORA_KINDS) -> None:
    """SPEC rule 8's runtime half: a LoRA-only checkpoint must hold every trainable parameter."""
    adapter_ids = {id(p) for p in adapter_parameters(model, kind)}
    extra = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in adapter_ids]
    if extra:
        raise ValueError(f"trainable parameters that are not LoRA parameters: {extra[:5]}")


@contextmanager
def adapter_disabled(model: nn.Module, kind: Any = LORA_KINDS) -> Iterator[None]:
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
    return _BASE_LAYERS.sub(".", param_name)  # nested wrappers (LoRAParam) add one `.base_layer` each


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
    wrapped = fold_targets(model)
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        m = wrapped.get(hf_name(name))
        yield hf_name(name), (m.folded_weight() if m is not None and m.enabled else p.detach())


def fold_targets(model: nn.Module) -> dict[str, Any]:
    """HF name of each adapted weight -> its LoRA module (`folded_weight()` gives the merged tensor)."""
    return {hf_name(_target_param(name, m)): m for name, m in lora_modules(model).items()}


def _target_param(name: str, m: nn.Module) -> str:
    """The raw parameter name (`named_parameters`) a LoRA module folds into."""
    if isinstance(m, LoRAParam):
        depth = 1
        inner = m.base_layer
        while isinstance(inner, LoRAParam):
            inner, depth = inner.base_layer, depth + 1
        return f"{name}{'.base_layer' * depth}.{m.param_name}"
    return f"{name}.base_layer.weight"


def peft_config_dict(model: nn.Module, spec: LoRASpec, base_model_path: str | None) -> dict[str, Any]:
    """adapter_config.json contents that `peft.LoraConfig` (and SGLang's loader) accept.

    target_modules are leaf names when they match exactly the wrapped set; on a model with a vision / audio
    region they are full paths: with a scope that excludes it, PEFT would re-target it, and with scope all the
    tower's leaves (`qkv`, `proj`, `linear_fc1`) are other names than the language model's.
    """
    wrapped = list(lora_modules(model, LoRALinear))
    params = peft_target_parameters(model)
    if params:  # an MoE model: its MLP linears go by path (see peft_target_parameters)
        params += [f"{n}.weight" for n in wrapped if ".mlp." in n]
        wrapped = [n for n in wrapped if ".mlp." not in n]
    leaves = sorted({n.rsplit(".", 1)[-1] for n in wrapped})
    if any(in_non_language_region(n) for n, _ in model.named_modules()):
        # a VL / omni model, whatever the scope: a leaf name would also match (or miss) modules of the other region
        targets: list[str] = wrapped
    else:
        targets = leaves
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "target_modules": targets,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        "inference_mode": True,
    }
    if params:  # peft refuses dropout on a ParamWrapper; the exported policy is the same without it
        config.update(target_parameters=params, lora_dropout=0.0)
    return config


def peft_target_parameters(model: nn.Module) -> list[str]:
    """PEFT `target_parameters` of the LoRAParam wrappers: fused experts as `mlp.experts.<param>` (gate_up
    before down: PEFT nests its wrappers in list order), routers by full path. On transformers 5, peft 0.21
    re-targets gate_proj / up_proj / down_proj in `target_modules` onto the fused experts (at rank 2r), so an MoE
    model's dense MLP linears are listed here by path too (by `peft_config_dict`)."""
    experts: list[str] = []
    others: list[str] = []
    for name, m in lora_modules(model, LoRAParam).items():
        path = name.replace(".base_layer", "")
        if m.experts:
            experts.append(f"{'.'.join(path.split('.')[-2:])}.{m.param_name}")
        else:
            others.append(f"{path}.{m.param_name}")
    order = ["gate_up_proj", "down_proj"]
    experts = sorted(set(experts), key=lambda t: (order.index(t.rsplit(".", 1)[-1]) if t.rsplit(".", 1)[-1] in order
                                                  else len(order), t))
    return experts + others
