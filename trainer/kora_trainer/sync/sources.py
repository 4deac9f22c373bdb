"""What a sync pushes, planned before anything is materialised.

A `Source` lists its tensors as groups of *meta* tensors (names, dtypes, shapes, no storage), so the
buckets are planned first and each bucket's real tensors are produced only when that bucket goes out:
a Merge push folds one bucket's weights at a time, so peak extra memory is about one bucket (plus the
largest single tensor), not a second copy of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kora_trainer.hf_experts import per_expert_views
from kora_trainer.lora import adapter_pairs, base_state
from kora_trainer.lora.model import fold_targets, hf_name
from kora_trainer.wire.gdn_lora import to_sglang_pairs

Named = tuple[str, torch.Tensor]


@dataclass
class Source:
    groups: list[list[Named]]  # meta tensors; a group of several (an A/B pair) travels in one bucket
    get: Callable[[Sequence[str]], dict[str, torch.Tensor]]  # names -> real tensors (folds, or live parameters)
    adapted: frozenset[str] | None = None  # Merge: the names a fold changes (the rest is the frozen base); None: all

    def only_adapted(self) -> Source:
        """The groups holding an adapted name (a Merge push after the first: the engine holds the rest already)."""
        if self.adapted is None:
            return self
        keep = self.adapted
        return Source([g for g in self.groups if any(n in keep for n, _ in g)], self.get, keep)

    @property
    def names(self) -> list[str]:
        return [n for g in self.groups for n, _ in g]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for g in self.groups for _, t in g)


def meta_tensor(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _per_expert_source(live: Mapping[str, torch.Tensor], make: Callable[[str], torch.Tensor],
                       adapted: Collection[str] | None = None) -> Source:
    """`live` (HF names -> tensors) as a Source whose fused MoE expert tensors go out under their per-expert
    names (hf_experts.py: what SGLang's load_weights and checkpoints use); `make(name)` produces a live name's
    tensor when its bucket goes out (once per bucket, however many of its experts the bucket holds)."""
    parent_of = {piece: n for n, t in live.items() for piece, _ in per_expert_views(n, meta_tensor(t))}
    groups = [[(piece, meta_tensor(v))] for n, t in live.items() for piece, v in per_expert_views(n, t.detach())]

    def get(names: Sequence[str]) -> dict[str, torch.Tensor]:
        made: dict[str, dict[str, torch.Tensor]] = {}
        for n in dict.fromkeys(parent_of[x] for x in names):
            made[n] = dict(per_expert_views(n, make(n)))
        return {x: made[parent_of[x]][x] for x in names}

    pieces = None if adapted is None else frozenset(x for x, n in parent_of.items() if n in adapted)
    return Source(groups, get, pieces)


def merged_source(model: nn.Module) -> Source:
    """Merge mode: the whole model, adapters folded in (W + s·B·A in fp32, rounded once), HF names."""
    live = {hf_name(n): p for n, p in model.named_parameters() if ".lora_A." not in n and ".lora_B." not in n}
    folded_modules = fold_targets(model)  # LoRALinear weights and LoRAParam (MoE experts, router) parameters

    def make(n: str) -> torch.Tensor:
        m = folded_modules.get(n)
        return m.folded_weight() if m is not None and m.enabled else live[n].detach()

    # a folded weight has its base weight's name, shape and dtype: plan from the base, fold per bucket
    return _per_expert_source(live, make, adapted=folded_modules.keys())


def base_source(model: nn.Module) -> Source:
    """Adapter mode, first sync: the frozen base under HF names, adapter tensors kept out."""
    live = dict(base_state(model))
    return _per_expert_source(live, lambda n: live[n])


def adapter_source(model: nn.Module) -> Source:
    """Adapter / EngineMerge: lora_A/lora_B under HF-PEFT names, each pair one group (never split)."""
    pairs = adapter_pairs(model)
    live = {n: t for pair in pairs for n, t in pair}
    groups = [[(a, meta_tensor(ta)), (b, meta_tensor(tb))] for (a, ta), (b, tb) in pairs]
    return Source(groups, lambda names: {n: live[n] for n in names})


def served_adapter_source(model: nn.Module, gate_adapters: bool) -> Source:
    """Adapter mode's pushes: `adapter_source`'s pairs under the names the engine's LoRA loader takes — SGLang's
    for GDN projections, b/a left out where the build carries none (wire/gdn_lora.py); others unchanged. The
    renamed pieces are row slices of the live B, taken again at every push."""
    def pairs() -> list[tuple[Named, Named]]:
        return to_sglang_pairs(adapter_pairs(model), gate_adapters)

    groups = [[(a, meta_tensor(ta)), (b, meta_tensor(tb))] for (a, ta), (b, tb) in pairs()]

    def get(names: Sequence[str]) -> dict[str, torch.Tensor]:
        now = {n: t for pair in pairs() for n, t in pair}
        return {n: now[n] for n in names}

    return Source(groups, get)
