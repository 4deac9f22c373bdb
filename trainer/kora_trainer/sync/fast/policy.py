"""What the fast path's plan reads from the policy: which tensor each pushed HF tensor is, and the adapter's
parameters. `PolicyPlan` names it; `HFPolicyPlan` is the torch backend's HF model with kora's LoRA (`merge_entries`,
`adapter_specs`: `sources.merged_source`'s / `sources.adapter_source`'s tensors in their order); a backend's sender
that gives its own (megatron's `MegatronWeightSender`: backends/megatron/sync.py) is its own plan.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn

from kora_trainer.hf_experts import per_expert_views
from kora_trainer.lora import adapter_pairs, adapter_parameters
from kora_trainer.lora.gdn import gdn_modules
from kora_trainer.lora.layer import LoRALinear
from kora_trainer.lora.model import hf_name, lora_modules
from kora_trainer.lora.params import LoRAParam
from kora_trainer.sync.fast.plan import Entry, FoldEntry, GatherSpec, PlainEntry
from kora_trainer.sync.sources import meta_tensor


@runtime_checkable
class PolicyPlan(Protocol):
    """The policy as the fast path plans it (raise NotImplementedError for what it does not cover)."""

    def fast_adapter_params(self) -> list[nn.Parameter]:
        """The adapter parameters (live, one dtype and device), the optimizer's order."""
        ...

    def fast_merge_entries(self) -> list[Entry]: ...

    def fast_adapter_specs(self) -> list[GatherSpec]: ...


class HFPolicyPlan:
    """`PolicyPlan` of an HF model with kora's LoRA (the torch backend's)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def fast_adapter_params(self) -> list[nn.Parameter]:
        return list(adapter_parameters(self.model))

    def fast_merge_entries(self) -> list[Entry]:
        return merge_entries(self.model)

    def fast_adapter_specs(self) -> list[GatherSpec]:
        return adapter_specs(self.model)


def policy_plan(sender: Any) -> PolicyPlan:
    """The plan of the policy `sender` pushes: the sender itself where its backend gives one, else its HF model's."""
    return sender if isinstance(sender, PolicyPlan) else HFPolicyPlan(sender.model)


def _no_parameter_adapters(model: nn.Module) -> None:
    if lora_modules(model, LoRAParam):
        raise NotImplementedError("adapters on bare parameters (MoE experts, routers) go through the HTTP path")


def merge_entries(model: nn.Module) -> list[Entry]:
    """Merge mode's fast-path plan: `merged_source`'s tensors in its order — every adapted Linear weight folded
    (W + s·B·A, fp32, rounded once) under its HF name, every other parameter as it is."""
    _no_parameter_adapters(model)
    linear = {f"{n}.base_layer.weight": m for n, m in lora_modules(model, LoRALinear).items()}
    entries: list[Entry] = []
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        hf = hf_name(name)
        if [n for n, _ in per_expert_views(hf, meta_tensor(p))] != [hf]:
            raise NotImplementedError(f"{hf}: fused MoE experts go out under per-expert names (the HTTP path)")
        m = linear.get(name)
        if m is not None and m.enabled:
            entries.append(FoldEntry([(hf, tuple(p.shape))], p.detach(), m.lora_A.weight.detach(),
                                     m.lora_B.weight.detach(), float(m.scaling)))
        else:
            entries.append(PlainEntry(hf, p.detach()))
    return entries


def adapter_specs(model: nn.Module) -> list[GatherSpec]:
    """Adapter mode's fast-path plan: every HF-PEFT tensor is one LoRA parameter, whole (`adapter_source`'s
    order)."""
    _no_parameter_adapters(model)
    if gdn_modules(model):
        raise NotImplementedError("GDN in_proj adapters go out under SGLang's fused names (the HTTP path)")
    return [GatherSpec(n, t) for pair in adapter_pairs(model) for n, t in pair]
