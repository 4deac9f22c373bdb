"""AdamW whose state is split over the data-parallel ranks (ZeRO stage 1), for one multi-LoRA slot.

The slot's parameters, flattened in their order, are cut into one contiguous range per data-parallel rank; a rank
keeps AdamW's moments for its range only (1 / data of the slot's optimizer memory). A step: the slot's gradients are
already summed over the ranks and clipped (every rank holds them whole), each rank runs torch's AdamW on its range
— the same elementwise update a whole-slot AdamW makes, so the result is bit-identical to it — and the updated
ranges are all-gathered back into every rank's parameters. Where the gradients' all-reduce could be a reduce-scatter
(NCCL) it is not: gloo (the CPU twins) has none, and the clip needs the whole gradient's norm anyway.

`state_dict` / `load_state_dict` speak torch's per-parameter AdamW layout (each parameter's moments whole and
shaped like it; a collective of the data-parallel group), so a slot's checkpoint is the same whatever the data size
and the tensor-parallel checkpoint code (backends/megatron/tp_checkpoint.py) reads it as it reads any AdamW's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kora_trainer.backends.data_parallel import DataParallel

MOMENTS = ("exp_avg", "exp_avg_sq")


class ShardedAdamW(torch.optim.AdamW):
    """torch's AdamW (lr, betas, eps, weight decay; its `param_groups` and `state` are this rank's range's) over
    `params`, its state split over `dp`'s ranks. `step` needs the whole, summed gradients on every rank."""

    def __init__(self, params: list[nn.Parameter], lr: float, dp: DataParallel, weight_decay: float = 0.0):
        if dp.group is None:
            raise ValueError("ShardedAdamW splits over a data-parallel group: use torch.optim.AdamW on one rank")
        self.full, self.dp = list(params), dp
        self.total = sum(p.numel() for p in self.full)
        self.chunk = -(-self.total // dp.size)  # every rank's range the same length (the last one padded)
        self.lo, self.hi = min(dp.rank * self.chunk, self.total), min((dp.rank + 1) * self.chunk, self.total)
        self.shard = nn.Parameter(self._flat([p.detach() for p in self.full])[self.lo:self.hi].clone())
        super().__init__([self.shard], lr=lr, weight_decay=weight_decay)

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    def _gathered(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's range of a flat tensor, joined: the whole [total] tensor (an all-gather)."""
        padded = torch.zeros(self.chunk, dtype=part.dtype, device=part.device)
        padded[:part.numel()] = part
        parts = [torch.empty_like(padded) for _ in range(self.dp.size)]
        dist.all_gather(parts, padded, group=self.dp.group.pg if self.dp.group is not None else None)
        return torch.cat(parts)[:self.total]

    def _unflat(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in self.full]), self.full, strict=True)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in (*self.full, self.shard):
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """This rank's range of the update, then every rank's gathered into the parameters (every rank calls it)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.full]
        self.shard.copy_(self._flat([p.detach() for p in self.full])[self.lo:self.hi])  # the parameters lead
        self.shard.grad = self._flat(grads)[self.lo:self.hi].clone()
        super().step()
        self.shard.grad = None
        for p, t in zip(self.full, self._unflat(self._gathered(self.shard.detach())), strict=True):
            p.copy_(t)

    def state_dict(self) -> dict[str, Any]:
        """torch's AdamW state_dict over the whole parameter list (moments gathered: a collective)."""
        mine = super().state_dict()
        group = {**mine["param_groups"][0], "params": list(range(len(self.full)))}
        st = mine["state"].get(0)
        if st is None:
            return {"state": {}, "param_groups": [group]}
        whole = {k: self._unflat(self._gathered(st[k])) for k in MOMENTS}
        state = {i: {"step": st["step"].clone(), **{k: whole[k][i].clone() for k in MOMENTS}}
                 for i in range(len(self.full))}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """From torch's AdamW layout over the whole parameter list: this rank's range of each moment."""
        group = {**state_dict["param_groups"][0], "params": [0]}
        st = state_dict["state"]
        if not st:
            self.state.clear()
            super().load_state_dict({"state": {}, "param_groups": [group]})
            return
        mine = {k: self._flat([st[i][k] for i in range(len(self.full))])[self.lo:self.hi].clone() for k in MOMENTS}
        super().load_state_dict({"state": {0: {"step": st[0]["step"], **mine}}, "param_groups": [group]})
