"""One LoRA-wrapped linear layer: y = W x + b + (alpha/r) · B A dropout(x)   (Hu et al. 2021,
https://arxiv.org/abs/2106.09685). Parameter names follow PEFT's module layout
(`base_layer`, `lora_A`, `lora_B`) so exporting to HF-PEFT names is a rename, not a reshuffle.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base_layer = base
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        dev, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=dev, dtype=dtype)  # weight [r, in]
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=dev, dtype=dtype)  # weight [out, r]
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True
        # rows of the adapter's output pinned to zero (`pin_rows`); None = every row trains
        self.row_mask: torch.Tensor | None
        self.register_buffer("row_mask", None, persistent=False)
        self.reset_lora()

    def reset_lora(self) -> None:
        # PEFT's default init: A as nn.Linear's own (kaiming-uniform, a=sqrt(5)), B = 0, so the
        # adapter starts as the identity change and training starts from the base policy exactly.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    @torch.no_grad()
    def pin_rows(self, rows: torch.Tensor) -> None:
        """Pin output rows `rows` ([out] bool, True = pinned) of the adapter to zero: their B rows are zeroed and
        the forward multiplies the delta by the mask, so they get exactly zero gradient and add nothing."""
        keep = (~rows).to(device=self.lora_B.weight.device, dtype=self.lora_B.weight.dtype)  # [out]
        self.lora_B.weight.mul_(keep.unsqueeze(1))
        self.row_mask = keep

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> torch.Tensor:  # code that inspects `.weight` (e.g. dtype checks) sees the base
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        out: torch.Tensor = self.base_layer(x)
        if not self.enabled:
            return out
        delta: torch.Tensor = self.lora_B(self.lora_A(self.dropout(x.to(self.lora_A.weight.dtype))))  # [..., out]
        if self.row_mask is not None:
            delta = delta * self.row_mask  # [..., out] * [out]: pinned rows carry no value and no gradient
        return out + (self.scaling * delta).to(out.dtype)

    @torch.no_grad()
    def folded_weight(self) -> torch.Tensor:
        """W + (alpha/r)·B·A, formed in fp32 and rounded to W's dtype once. [out, in]"""
        w = self.base_layer.weight
        b = self.lora_B.weight.float()  # [out, r]
        if self.row_mask is not None:
            b = b * self.row_mask.float().unsqueeze(1)
        delta = b @ self.lora_A.weight.float()  # [out, r] @ [r, in]
        return (w.float() + self.scaling * delta).to(w.dtype)

    def extra_repr(self) -> str:
        pinned = "" if self.row_mask is None else f", pinned_rows={int((self.row_mask == 0).sum())}"
        return f"rank={self.rank}, alpha={self.alpha}, enabled={self.enabled}{pinned}"
