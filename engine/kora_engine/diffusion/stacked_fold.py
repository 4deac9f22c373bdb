"""The diffusion engine's lora_merge with a few launches per push instead of a few per layer.

A push's time on a GPU went to per-layer work, not bytes (docs/diffusion.md "Measured": 191 folds of three kernels
each on SD3-medium). Nearly all adapted weights of a diffusion transformer share a shape (SD3-medium: 1536 x 1536
for every attention projection), so the engine stacks them: per shape group, the pristine bases live in one
[n, out, in] tensor and the model's weights become views of one live [n, out, in] tensor (made once per bucket
layout: the "plan"). A fold is then, per group, two stacks of the pushed factors, one bmm, one scaling and one
add straight into the live stack — the same ops in the same order as `wire/diffusion_lora.fold_from_pristine` and the
trainer's `folded_weight` (B A, the scaling, the sum; fp32 when the base is fp32), so on the CPU it is bit-equal to
them (bmm of a stack = mm per layer there; on a GPU cuBLAS may round the batched GEMM differently).

A plan is keyed by the bucket's layer order; a bucket of another order re-plans (re-pointing the weights it
covers; an older plan touching any of them is dropped).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass

import torch

from kora_trainer.wire.diffusion_lora import Named, checked_pairs


@dataclass
class _Group:
    """One shape group of a bucket layout: its layers' weight keys in bucket order, their stacks."""

    prefixes: list[str]
    pristine: torch.Tensor  # [n, out, in]: the bases as loaded (the engine's pristine dict holds views of it)
    live: torch.Tensor  # [n, out, in]: the model's weights are views of it


class StackedFolds:
    """lora_merge folds into `params` (the model's parameters by name) from `pristine` (same keys), planned per
    bucket layout. `pristine`'s values are replaced by views of the plan's stacks (no second copy)."""

    def __init__(self, params: MutableMapping[str, torch.nn.Parameter], pristine: MutableMapping[str, torch.Tensor]):
        self.params, self.pristine = params, pristine
        self.plans: dict[tuple[str, ...], list[_Group]] = {}

    def apply(self, bucket: Iterable[Named], lora_alpha: float, lora_rank: int) -> int:
        """Fold one checked bucket into the live weights; the number of weights written."""
        pairs = checked_pairs(bucket, self.pristine, self.params)
        groups = self.plans.get(tuple(pairs)) or self._plan(list(pairs))
        scaling = lora_alpha / lora_rank
        with torch.no_grad():
            for g in groups:  # fp32 throughout, rounded once to the weights' dtype (the seed's fp32 merge)
                b = torch.stack([pairs[p]["lora_B"] for p in g.prefixes]).float()  # [n, out, r]
                a = torch.stack([pairs[p]["lora_A"] for p in g.prefixes]).float()  # [n, r, in]
                delta = torch.bmm(b, a)
                delta.mul_(scaling)
                if g.live.dtype == torch.float32:
                    torch.add(g.pristine, delta, out=g.live)
                else:
                    g.live.copy_(g.pristine.float() + delta)
        return len(pairs)

    def _plan(self, prefixes: list[str]) -> list[_Group]:
        keys = {p: f"{p}.weight" for p in prefixes}
        covered = set(prefixes)
        self.plans = {k: v for k, v in self.plans.items() if covered.isdisjoint(k)}
        by_shape: dict[tuple[tuple[int, ...], torch.dtype], list[str]] = {}
        for p in prefixes:
            w = self.params[keys[p]]
            by_shape.setdefault((tuple(w.shape), w.dtype), []).append(p)
        groups = []
        with torch.no_grad():
            for members in by_shape.values():
                pristine = torch.stack([self.pristine[keys[p]] for p in members])
                live = torch.stack([self.params[keys[p]].data for p in members])
                for i, p in enumerate(members):
                    self.pristine[keys[p]] = pristine[i]
                    self.params[keys[p]].data = live[i]
                groups.append(_Group(members, pristine, live))
        self.plans[tuple(prefixes)] = groups
        return groups
