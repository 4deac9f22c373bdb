"""The megatron policy's adapter under HF-PEFT (or SGLang) names, and back.

Adapter mode pushes `hf_adapter_tensors`, EngineMerge pushes the same pairs, Merge mode pushes
`model.hf_state(merged=True)`, the HF-PEFT export writes `hf_adapter_tensors` + `peft_config`. All are
collective over the tensor-parallel group: every TP rank calls them; sharded factors are all-gathered.

Attention / dense-MLP linears and MoE routers are one (A, B) pair per HF module (convert.py names them); the
MoE experts' wrappers are grouped per layer in PEFT's `target_parameters` layout (moe.py).

PEFT config of an MoE model: on transformers 5 peft rewrites `target_modules` entries named gate / gate_proj /
up_proj / down_proj onto the fused expert parameters (with a doubled rank for gate_up_proj), so there every
MLP-side adapter goes into `target_parameters`: the experts as `mlp.experts.{gate_up_proj,down_proj}`, the
routers and any dense MLP layer's projections by full parameter path (`model.layers.{i}.mlp.gate.weight`, ...);
the attention projections stay `target_modules` leaves. A dense model's config is unchanged (leaves only).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kora_trainer.backends.megatron import parallel  # called as parallel.X(): tests put a fake rank layout there
from kora_trainer.backends.megatron.convert import (
    PEFT_PREFIX,
    REPL,
    TARGET_OF,
    Layout,
    adapter_from_hf,
    adapter_modules,
    adapter_to_hf,
    column_parallel,
    hf_adapter_module,
)
from kora_trainer.backends.megatron.lora import MegatronLoRA, lora_modules
from kora_trainer.backends.megatron.moe import (
    expert_adapter_tensors,
    expert_target_parameters,
    is_expert_module,
    load_expert_adapter,
)
from kora_trainer.backends.megatron.parallel import gather_tp
from kora_trainer.checkpoint.peft_export import adapter_config, export_peft
from kora_trainer.config import LoRASpec, TargetModule


def _targets(model: nn.Module) -> list[TargetModule]:
    return sorted({TARGET_OF[name.rsplit(".", 1)[-1]] for name in lora_modules(model)}, key=str)


def _paired(model: nn.Module, layout: Layout, flavour: str = "hf"
            ) -> Iterator[tuple[MegatronLoRA, tuple[str, ...], str]]:
    """(wrapper, HF module paths, kind) for every LoRA wrapper but the MoE experts' (moe.py groups those)."""
    mapping = adapter_modules(layout, _targets(model), flavour)
    for name, m in lora_modules(model).items():
        if name in mapping:
            yield m, *mapping[name]
        elif not is_expert_module(name):
            raise KeyError(f"LoRA module {name} has no HF-PEFT name in the mapping of {layout}")


def hf_adapter_tensors(model: nn.Module, layout: Layout, flavour: str = "hf") -> dict[str, torch.Tensor]:
    """Every adapter pair under HF-PEFT names (`base_model.model.<module>.lora_{A,B}.weight`), full size;
    MoE experts in PEFT's grouped layout."""
    out: dict[str, torch.Tensor] = {}
    for m, hf_modules, kind in _paired(model, layout, flavour):
        a, b = m.lora_A.weight.detach(), m.lora_B.weight.detach()
        if kind == REPL:  # the router: both factors whole on every rank
            a_shards, b_shards = [a], [b]
        else:
            a_shards, b_shards = ([a], gather_tp(b)) if column_parallel(kind) else (gather_tp(a), [b])
        out.update(adapter_to_hf(hf_modules, kind, a_shards, b_shards, layout))
    out.update(expert_adapter_tensors(model, layout))
    return out


def load_hf_adapter(model: nn.Module, tensors: Mapping[str, torch.Tensor], layout: Layout) -> None:
    """Set every wrapper's A and B from HF-PEFT tensors (this TP rank's shards). Every tensor must be used."""
    used: set[str] = set()
    tensors = dict(tensors)
    for m, hf_modules, kind in _paired(model, layout):
        m.load_factors(*adapter_from_hf(hf_modules, kind, tensors, layout, m.tp_rank, m.tp_size))
        used.update(f"{PEFT_PREFIX}{h}.lora_{w}.weight" for h in hf_modules for w in "AB")
    used |= load_expert_adapter(model, tensors, layout)
    unused = sorted(set(tensors) - used)
    if unused:
        raise KeyError(f"adapter tensors with no megatron LoRA module to go to: {unused[:5]}")


def peft_targets(wrapped: Iterable[str]) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) for PEFT, from the megatron LoRA module paths (module docstring)."""
    names = list(wrapped)
    params = expert_target_parameters(names)
    moe = bool(params) or any(n.endswith(".mlp.router") for n in names)
    leaves: set[str] = set()
    for name in names:
        if is_expert_module(name):
            continue
        hf_modules, _ = hf_adapter_module(name)
        if moe and ".mlp." in name:  # a router, or a dense MLP layer of an MoE model
            params += [f"{h}.weight" for h in hf_modules]
        else:
            leaves.update(h.rsplit(".", 1)[-1] for h in hf_modules)
    return sorted(leaves), params


def peft_config(model: nn.Module, spec: LoRASpec, base_model: str, wrapped: Iterable[str] | None = None
                ) -> dict[str, Any]:
    """adapter_config.json for the model's LoRA modules (`wrapped`: every pipeline stage's, when given)."""
    modules, params = peft_targets(lora_modules(model) if wrapped is None else wrapped)
    return adapter_config(base_model=base_model, rank=spec.rank, alpha=spec.alpha, target_modules=modules,
                          dropout=spec.dropout, target_parameters=params)


def export_hf_peft(model: nn.Module, layout: Layout, spec: LoRASpec, base_model: str, root: str | Path,
                   meta: Mapping[str, Any] | None = None) -> Path | None:
    """Write `root/lora_adapter/` (HF-PEFT) from TP rank 0; other ranks take part in the gather only."""
    tensors = hf_adapter_tensors(model, layout)
    if parallel.tp_rank_size()[0] != 0:
        return None
    return export_peft(Path(root), tensors, peft_config(model, spec, base_model),
                       {"backend": "megatron", **(meta or {})})
