"""A rank's local layer and expert numbers mapped onto the whole model's: megatron numbers a pipeline stage's layers
from 0 and an expert-parallel rank's experts from 0, while everything kora names a parameter by (the HF maps, the
adapter's names, checkpoints, sync) takes the global indices. Below model.py and lora.py, which both name by it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kora_trainer.backends.megatron.parallel import ep_rank_size

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class Numbering:
    """How this rank's local layer and expert indices map onto the model's: its pipeline stage's layers (local ->
    global index) and its expert-parallel share of every MoE layer's experts (a contiguous block)."""

    layers: Mapping[int, int]
    expert_offset: int = 0  # the global index of this rank's first local expert
    local_experts: int = 0  # experts per MoE layer on this rank (0: a dense model)

    def owns_expert(self, index: int) -> bool:
        return self.local_experts == 0 or self.expert_offset <= index < self.expert_offset + self.local_experts


def numbering(model: torch.nn.Module) -> Numbering:
    """This rank's `Numbering` (a layer without megatron's `layer_number` keeps its own index, and a model without
    megatron's config holds every expert: the CPU tests' stand-ins for megatron modules)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    index = {} if layers is None else {int(name): int(getattr(layer, "layer_number", int(name) + 1)) - 1
                                       for name, layer in layers.named_children()}
    experts = int(getattr(getattr(model, "config", None), "num_moe_experts", None) or 0)
    if not experts:
        return Numbering(index)
    rank, size = ep_rank_size()
    return Numbering(index, rank * (experts // size), experts // size)


def global_name(name: str, n: Numbering) -> str:
    """A rank-local module or parameter name under its global layer and expert indices (`numbering`)."""
    m = _LOCAL_LAYER.match(name)
    if m is None:
        return name
    local = int(m.group(1))
    name = f"decoder.layers.{n.layers.get(local, local)}.{name[m.end():]}"
    if n.expert_offset and (e := LOCAL_EXPERT.search(name)) is not None:
        name = f"{name[:e.start()]}.mlp.experts.local_experts.{n.expert_offset + int(e.group(1))}.{name[e.end():]}"
    return name
