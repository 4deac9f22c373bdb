"""LoRA on a bare parameter (PEFT's `target_parameters`, its ParamWrapper), for what transformers 5 keeps as
parameters rather than nn.Linear layers: the fused MoE experts (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]) and the MoE router (`mlp.gate.weight` [E, H]).

- A 2-D weight W [out, in] gets W + s·B·A, A [r, in], B [out, r].
- A 3-D weight W [E, out, in] gets one (A_e, B_e) per expert, held in PEFT's grouped layout: lora_A [E·r, in]
  (the A_e stacked, expert-major rows) and lora_B [out, r·E] (column j·E + e = column j of B_e). `grouped.py`
  converts between that and per-expert factors (the megatron backend's experts are per-expert modules).
- Two parameters of one module nest as PEFT's wrappers do: the second wraps the first as `base_layer`, so the
  module paths — and with them the HF-PEFT tensor names (`…mlp.experts.base_layer.lora_A.weight` for
  gate_up_proj, `…mlp.experts.lora_A.weight` for down_proj) — are PEFT's, and `PeftModel.from_pretrained` loads
  the export.

Forward: the wrapped module runs unchanged with the effective parameters (`torch.func.functional_call`), formed
once per call, so the experts' own routing loop reads W_e + s·B_e·A_e. No dropout (peft refuses it on a
ParamWrapper too). Init is PEFT's: A kaiming-uniform, B = 0, so training starts at the base.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from kora_trainer.lora.grouped import grouped_delta


class DelegatesToBase(nn.Module):
    """A wrapper that stands in for its `base_layer`: what the parent module reads off the wrapped one
    (num_experts, top_k, a megatron router's config, ...) is the wrapped one's."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__.get("_modules", {}).get("base_layer")
            if base is None:
                raise
            return getattr(base, name)


class LoRAParam(DelegatesToBase):
    def __init__(self, base: nn.Module, param: str, rank: int, alpha: float):
        super().__init__()
        self.base_layer = base
        self.param_name = param
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        w = self.target()
        if w.dim() not in (2, 3):
            raise ValueError(f"LoRA on parameter {param} of shape {tuple(w.shape)}: only 2-D or 3-D (experts)")
        self.experts = w.shape[0] if w.dim() == 3 else 0
        out_f, in_f = w.shape[-2:]
        groups = max(self.experts, 1)
        kw = {"device": w.device, "dtype": w.dtype}
        self.lora_A = nn.Linear(in_f, rank * groups, bias=False, **kw)  # weight [E·r, in]
        self.lora_B = nn.Linear(rank * groups, out_f, bias=False, **kw)  # weight [out, r·E]
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.enabled = True

    def innermost(self) -> nn.Module:
        """The module that owns the parameter (below any other LoRAParam wrapping the same module)."""
        m: nn.Module = self.base_layer
        while isinstance(m, LoRAParam):
            m = m.base_layer
        return m

    def target(self) -> torch.Tensor:
        return self.innermost().get_parameter(self.param_name)

    def delta(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """s·B·A shaped like the parameter ([out, in], or [E, out, in] per expert), in `dtype` (A's if None)."""
        a, b = self.lora_A.weight, self.lora_B.weight
        if dtype is not None:
            a, b = a.to(dtype), b.to(dtype)
        return self.scaling * (grouped_delta(a, b, self.experts) if self.experts else b @ a)

    @torch.no_grad()
    def folded_weight(self) -> torch.Tensor:
        """W + s·B·A formed in fp32 and rounded to W's dtype once (Merge mode)."""
        w = self.target()
        return (w.float() + self.delta(torch.float32)).to(w.dtype)

    def forward(self, *args: Any, _kora_params: dict[str, torch.Tensor] | None = None, **kwargs: Any) -> Any:
        params = dict(_kora_params or {})
        if self.enabled:
            w = self.target()
            params[self.param_name] = w + self.delta().to(w.dtype)
        if isinstance(self.base_layer, LoRAParam):
            return self.base_layer(*args, _kora_params=params, **kwargs)
        return functional_call(self.base_layer, params, args, kwargs)

    def extra_repr(self) -> str:
        return f"param={self.param_name}, rank={self.rank}, alpha={self.alpha}, experts={self.experts}"
