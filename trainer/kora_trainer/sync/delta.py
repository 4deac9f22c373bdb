"""Delta-skip: do not push an adapter that has not moved since the last push.

The decision is collective. With tensor/pipeline parallelism each trainer rank holds a different
slice of the adapter, so one rank can see movement that another does not. Every rank computes the
largest |Δ| of ITS tensors since the last push, the trainer's group all-reduces the MAX, and every
rank gets the same answer. A per-rank early return would leave the ranks that did move waiting in the
push's collectives for a rank that went home — a hang (Relax's LoRA docs warn of exactly this).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kora_trainer.wire.group import WeightUpdateGroup

Named = tuple[str, torch.Tensor]


class DeltaTracker:
    """Keeps a copy of the adapter as last pushed (fp32, on the tensors' device)."""

    def __init__(self) -> None:
        self._pushed: dict[str, torch.Tensor] | None = None

    @property
    def ever_pushed(self) -> bool:
        return self._pushed is not None

    @torch.no_grad()
    def local_max_delta(self, named: Iterable[Named]) -> float:
        """max |current − last pushed| over this rank's tensors; inf before the first push."""
        if self._pushed is None:
            return float("inf")
        now, before = [], []
        for name, t in named:
            b = self._pushed.get(name)
            if b is None or b.shape != t.shape:
                return float("inf")
            if t.numel():
                now.append(t.float())
                before.append(b)
        if not now:
            return 0.0
        # every tensor's max |Δ| on its device, then ONE host read: a read per tensor waits for the device each time
        worst = torch._foreach_norm(torch._foreach_sub(now, before), float("inf"))
        return float(torch.stack(worst).max())

    @torch.no_grad()
    def mark_pushed(self, named: Iterable[Named]) -> None:
        self._pushed = {name: t.detach().float().clone() for name, t in named}


def collective_max(value: float, group: WeightUpdateGroup | None) -> float:
    """MAX over the trainer's ranks (a no-op without a group or with one rank)."""
    if group is None or group.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=group.device)
    group.allreduce_max(t)
    return float(t.item())


def should_push(tracker: DeltaTracker, named: Iterable[Named], threshold: float,
                group: WeightUpdateGroup | None = None) -> tuple[bool, float]:
    """(push?, the group's max delta). Every rank of `group` must call this, every step."""
    delta = collective_max(tracker.local_max_delta(named), group)
    return delta > threshold, delta
