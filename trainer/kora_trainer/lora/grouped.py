"""PEFT's grouped layout for LoRA on fused MoE experts (a ParamWrapper on a 3-D [E, out, in] parameter):
lora_A [E·r, in] holds the experts' A_e stacked (expert-major rows); lora_B [out, r·E] holds the B_e
interleaved (column j·E + e = column j of B_e, rank-major). One layout for every place that reads or writes it:
the torch backend's `LoRAParam`, the megatron backend's per-expert wrappers (backends/megatron/moe.py), the
reference engine, and `kora merge`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_expert_factors(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert A_e [r, in], B_e [out, r] -> grouped lora_A [E·r, in], lora_B [out, r·E]."""
    grouped_b = torch.stack(list(b), dim=-1)  # [out, r, E]
    return torch.cat(list(a), dim=0), grouped_b.reshape(grouped_b.shape[0], -1)


def split_expert_factors(a: torch.Tensor, b: torch.Tensor, experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of `group_expert_factors`: [(A_e, B_e)] for e in 0..experts-1."""
    r = a.shape[0] // experts
    a3, b3 = a.reshape(experts, r, -1), b.reshape(b.shape[0], r, experts)  # [E, r, in], [out, r, E]
    return [(a3[e], b3[:, :, e]) for e in range(experts)]


def grouped_delta(a: torch.Tensor, b: torch.Tensor, experts: int) -> torch.Tensor:
    """B_e·A_e for every expert, [E, out, in], from the grouped factors (no scaling)."""
    r = a.shape[0] // experts
    a3 = a.reshape(experts, r, a.shape[1])  # [E, r, in]
    b3 = b.reshape(b.shape[0], r, experts).permute(2, 0, 1)  # [E, out, r]
    return torch.bmm(b3, a3)
