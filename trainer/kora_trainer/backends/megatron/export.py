"""The megatron policy's adapter under HF-PEFT (or SGLang) names, and back.

Adapter mode pushes `hf_adapter_tensors`, EngineMerge pushes the same pairs, Merge mode pushes
`model.hf_state(merged=True)`, the HF-PEFT export writes `hf_adapter_tensors` + `peft_config`. All are
collective over the tensor-parallel group: every TP rank calls them; sharded factors are all-gathered.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kora_trainer.backends.megatron.convert import (
    Layout,
    adapter_from_hf,
    adapter_modules,
    adapter_to_hf,
    column_parallel,
)
from kora_trainer.backends.megatron.lora import lora_modules
from kora_trainer.backends.megatron.parallel import gather_tp
from kora_trainer.config import MEGATRON_TO_HF, LoRASpec, TargetModule


def _targets(model: nn.Module) -> list[TargetModule]:
    from kora_trainer.backends.megatron.convert import TARGET_OF

    return sorted({TARGET_OF[name.rsplit(".", 1)[-1]] for name in lora_modules(model)}, key=str)


def hf_adapter_tensors(model: nn.Module, layout: Layout, flavour: str = "hf") -> dict[str, torch.Tensor]:
    """Every adapter pair under HF-PEFT names (`base_model.model.<module>.lora_{A,B}.weight`), full size."""
    mapping = adapter_modules(layout, _targets(model), flavour)
    out: dict[str, torch.Tensor] = {}
    for name, m in lora_modules(model).items():
        hf_modules, kind = mapping[name]
        a, b = m.lora_A.weight.detach(), m.lora_B.weight.detach()
        a_shards, b_shards = ([a], gather_tp(b)) if column_parallel(kind) else (gather_tp(a), [b])
        out.update(adapter_to_hf(hf_modules, kind, a_shards, b_shards, layout))
    return out


@torch.no_grad()
def load_hf_adapter(model: nn.Module, tensors: Mapping[str, torch.Tensor], layout: Layout) -> None:
    """Set every wrapper's A and B from HF-PEFT tensors (this TP rank's shards). Every tensor must be used."""
    mapping = adapter_modules(layout, _targets(model))
    used: set[str] = set()
    tensors = dict(tensors)
    for name, m in lora_modules(model).items():
        hf_modules, kind = mapping[name]
        a, b = adapter_from_hf(hf_modules, kind, tensors, layout, m.tp_rank, m.tp_size)
        m.lora_A.weight.copy_(a.to(m.lora_A.weight.device, m.lora_A.weight.dtype))
        m.lora_B.weight.copy_(b.to(m.lora_B.weight.device, m.lora_B.weight.dtype))
        used.update(f"base_model.model.{h}.lora_{w}.weight" for h in hf_modules for w in "AB")
    unused = sorted(set(tensors) - used)
    if unused:
        raise KeyError(f"adapter tensors with no megatron LoRA module to go to: {unused[:5]}")


def peft_config(model: nn.Module, spec: LoRASpec, base_model: str) -> dict[str, Any]:
    from kora_trainer.checkpoint.peft_export import adapter_config

    leaves = [leaf for t in _targets(model) for leaf in MEGATRON_TO_HF[t]]
    return adapter_config(base_model=base_model, rank=spec.rank, alpha=spec.alpha, target_modules=leaves,
                          dropout=spec.dropout)


def export_hf_peft(model: nn.Module, layout: Layout, spec: LoRASpec, base_model: str, root: str | Path,
                   meta: Mapping[str, Any] | None = None) -> Path | None:
    """Write `root/lora_adapter/` (HF-PEFT) from TP rank 0; other ranks take part in the gather only."""
    from kora_trainer.backends.megatron.parallel import tp_rank_size
    from kora_trainer.checkpoint.peft_export import export_peft

    tensors = hf_adapter_tensors(model, layout)
    if tp_rank_size()[0] != 0:
        return None
    return export_peft(Path(root), tensors, peft_config(model, spec, base_model),
                       {"backend": "megatron", **(meta or {})})
