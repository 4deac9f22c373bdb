"""Adapter slots on one LoRA-wrapped base (multi-LoRA): each adapter its own A/B factors, rank, alpha and dropout
stream; one of them active at a time.

The model is wrapped once (`apply_lora` at the job's lora.rank, the largest rank a slot holds). A slot keeps its
own Parameters for every wrapped module; `active(name)` points each module's `lora_A.weight` / `lora_B.weight` at
the slot's (an attribute swap: nothing is copied), sets its scaling, and swaps in the slot's own CPU RNG stream
(dropout draws), so what a forward/backward does to one adapter is exactly what it would do with that adapter
alone on the base — gradients land in the slot's Parameters and stay there while other slots run. Outside
`active`, the adapters are off: the model is the base.

Every view `lora/model.py` gives (adapter_pairs, adapter_tensors, peft_config_dict) reads the active slot.
MoE expert and router adapters (`LoRAParam`, PEFT's `target_parameters`) swap the same way: a fused-expert
parameter [E, out, in] holds one (A_e, B_e) per expert (per-expert, as miles #1794 defaults to) in PEFT's grouped
layout at the slot's rank — lora_A [E·r, in], lora_B [out, r·E] (lora/grouped.py) — and the router a plain
A [r, in], B [out, r]; neither draws dropout (a ParamWrapper has none), so only dense slots use the RNG stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from kora_trainer.lora.layer import LoRALinear
from kora_trainer.lora.model import LORA_KINDS, lora_modules
from kora_trainer.lora.params import LoRAParam

Wrapped = LoRALinear | LoRAParam


@dataclass
class Slot:
    name: str
    rank: int
    alpha: float
    # module name -> (A [r, in], B [out, r]); a fused-expert parameter's grouped (A [E·r, in], B [out, r·E])
    factors: dict[str, tuple[nn.Parameter, nn.Parameter]]
    rng: torch.Tensor  # its CPU RNG state while it is not active

    @property
    def params(self) -> list[nn.Parameter]:
        """A then B of every module, in module order: the optimizer's order (and the checkpoint's)."""
        return [p for a, b in self.factors.values() for p in (a, b)]


class AdapterSlots:
    def __init__(self, model: nn.Module):
        self.model = model
        self.modules: dict[str, Wrapped] = lora_modules(model, LORA_KINDS)
        self.max_rank = max(m.rank for m in self.modules.values())
        self.slots: dict[str, Slot] = {}
        self.current: str | None = None
        self._off()

    def add(self, name: str, rank: int, alpha: float, seed: int) -> Slot:
        """A fresh adapter: PEFT's init (A kaiming-uniform, B = 0) drawn from its own seed, so it starts the same
        whichever slots exist beside it."""
        if name in self.slots:
            raise ValueError(f"adapter {name} already holds a slot")
        if rank > self.max_rank:
            raise ValueError(f"adapter {name}: rank {rank} exceeds the slots' rank {self.max_rank} (lora.rank)")
        gen = torch.Generator().manual_seed(seed)
        factors = {}
        for mod_name, m in self.modules.items():
            ref = m.lora_A.weight  # the job-rank factor the wrapper was built with: the slot's device and dtype
            groups, in_f, out_f = _shape(m)
            a = torch.empty(rank * groups, in_f, dtype=ref.dtype)
            _kaiming_uniform(a, gen)
            b = torch.zeros(out_f, rank * groups, dtype=ref.dtype)
            factors[mod_name] = (nn.Parameter(a.to(ref.device)), nn.Parameter(b.to(ref.device)))
        slot = Slot(name, rank, alpha, factors, torch.Generator().manual_seed(seed + 1).get_state())
        self.slots[name] = slot
        return slot

    def remove(self, name: str) -> None:
        if self.current == name:
            raise RuntimeError(f"adapter {name} is active: leave `active` first")
        self.slots.pop(name)

    @contextmanager
    def active(self, name: str) -> Iterator[Slot]:
        """The model runs adapter `name` inside the block (its dropout from its own RNG stream)."""
        if self.current is not None:
            raise RuntimeError(f"adapter {self.current} is already active")
        slot = self.slots[name]
        for mod_name, m in self.modules.items():
            a, b = slot.factors[mod_name]
            m.lora_A.weight, m.lora_B.weight = a, b
            m.rank, m.alpha, m.scaling, m.enabled = slot.rank, slot.alpha, slot.alpha / slot.rank, True
        outer_rng = torch.get_rng_state()
        torch.set_rng_state(slot.rng)
        self.current = name
        try:
            yield slot
        finally:
            slot.rng = torch.get_rng_state()
            torch.set_rng_state(outer_rng)
            self.current = None
            self._off()

    def _off(self) -> None:
        for m in self.modules.values():
            m.enabled = False


def _shape(m: Wrapped) -> tuple[int, int, int]:
    """(factor groups, in, out): a fused-expert parameter [E, out, in] has one (A_e, B_e) per expert; a dense
    linear or a 2-D router weight one pair."""
    if isinstance(m, LoRAParam):
        out_f, in_f = m.target().shape[-2:]
        return max(m.experts, 1), in_f, out_f
    return 1, m.in_features, m.out_features


def _kaiming_uniform(t: torch.Tensor, gen: torch.Generator) -> None:
    """nn.Linear's own init (kaiming-uniform, a = sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)), from `gen`."""
    bound = 1.0 / math.sqrt(t.shape[1]) if t.shape[1] else 0.0
    with torch.no_grad():
        t.uniform_(-bound, bound, generator=gen)
