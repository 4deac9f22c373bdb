"""Multi-LoRA on the megatron backend: adapter slots on megatron-core's tensor-parallel LoRA wrappers (lora.py),
each with its own AdamW, step count, gradient clipping, learning rate and version, at data, tensor and pipeline
parallel as the single-adapter megatron path runs them.

Slots (`MegatronAdapterSlots`): the torch slots' attribute swap (lora/slots.py) on the megatron wrappers. A slot
holds, for every wrapped linear, THIS RANK's part of its factors, shaped and marked as the wrapper's own: a column-
parallel linear's B sharded on rows and A whole, a row-parallel one's A sharded on columns and B whole, with
megatron's `tensor_model_parallel` / `partition_dim` / `partition_stride` and kora's `sequence_parallel` marks
copied from the wrapper's own factors, so the TP-aware clip, the sequence-parallel gradient sums and the TP
checkpoint gather treat a slot's parameters exactly as the single adapter's. A slot's A is drawn as apply_lora draws
it (PEFT's init at full size from a generator seeded with (its seed, the module's global name), then sliced), so
a slot starts the same whatever the TP and pipeline sizes and whichever slots exist beside it.

The step is the torch slot trainer's (backends/multi_lora.py `_accumulate` per unit, `_step` per batch: streaming
and the adapter's own schedule come with it) with megatron's hooks: micro-batches
forward and backward one by one, or through megatron's 1F1B schedule at pipeline > 1 (the last stage computes the
losses: the metrics are summed over the stages), the TP/PP-aware gradient-norm clip, and the slot's gradients
summed over the data-parallel group (its sequence-parallel factors over the TP group too) before its own AdamW
steps.

Optimizer: one AdamW per slot, its state split over the data-parallel ranks at data > 1 (`ShardedAdamW`,
backends/sharded_adamw.py: ZeRO stage 1 on the slot's flat parameters, bit-identical to a whole-slot AdamW) and
over TP as the factors are. Not megatron-core's own machinery: its `DistributedOptimizer` is built on megatron's
`DistributedDataParallel`, which lays a module's trainable parameters into one contiguous grad buffer and hooks them
at construction, while a slot's Parameters are swapped in and out of the same modules per train call and come and
go at runtime (one DDP per slot would need a model copy per slot); its `LayerWiseDistributedOptimizer` (what miles
runs per slot; "experimental" in megatron-core 0.16.1) splits whole parameters over the ranks and all-gathers them
after the step as ShardedAdamW does, but through megatron's optimizer stack (OptimizerConfig, process-group
collections, `main_grad`, its own clip) and its dist-checkpointing state dict, where a slot's checkpoint is torch's
AdamW layout (tp_checkpoint.py gathers it over TP and the stages).

What leaves the trainer is gathered over TP, the pipeline stages and expert parallelism, as the single-adapter
megatron export does: `adapter_named` gives HF-PEFT names (export.py), `state` the slot's factors and AdamW
state whole in megatron's one-rank layout (tp_checkpoint.py, written once by global rank 0, resumable at another
TP / pipeline size), and `make_sender` a `SlotSender` with megatron's HF sources (sync.py).

MoE (Qwen3-MoE): the experts' linears (linear_fc1 / linear_fc2: one (A, B) per expert, as apply_lora wraps them) and
the routers (lora.LoRARouter: A and B whole on every rank) hold slot factors like any wrapper. Under expert
parallelism a slot holds this rank's experts' factors only (marked `expert_parallel` as the wrapper's own are), their
gradients summed over the expert-data-parallel group instead of the data-parallel one and their squares over the
expert-parallel group in the clip (backend.py, as the single adapter's); its AdamW state is split over the
expert-data-parallel group (the ranks holding the same experts) rather than the data-parallel one, whole where that
group is one rank or holds TP peers. Exported in PEFT's grouped `target_parameters` layout, every expert gathered
(moe.py), the names the torch slots write for the same model.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from kora_trainer.backends.data_parallel import DataParallel
from kora_trainer.backends.grpo_step import ForwardBackward, one_by_one
from kora_trainer.backends.megatron.backend import MegatronBackend, clip_grad_norm
from kora_trainer.backends.megatron.export import peft_config
from kora_trainer.backends.megatron.lora import (
    LoRAColumnParallelLinear,
    LoRARouter,
    MegatronLoRA,
    _ParallelLoRA,
    adapter_disabled,
    all_lora_modules,
    lora_modules,
    module_seed,
)
from kora_trainer.backends.megatron.moe import is_expert_module
from kora_trainer.backends.megatron.pipeline import pipeline_forward_backward
from kora_trainer.backends.megatron.sync import MegatronWeightSender
from kora_trainer.backends.megatron.tp_checkpoint import TensorShards
from kora_trainer.backends.multi_lora import MultiLoRATrainer, schedule_fields
from kora_trainer.backends.sharded_adamw import ShardedAdamW
from kora_trainer.checkpoint.lora_only import select_state
from kora_trainer.lora.slots import AdapterSlots, Slot
from kora_trainer.sync.sender import SyncReport
from kora_trainer.sync.slot_sender import SlotSender
from kora_trainer.wire.group import WeightUpdateGroup

# what megatron (and kora's wrappers) mark on a LoRA factor; a slot's factors carry the same marks
PARALLEL_MARKS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                  "expert_parallel")
NAMES = "names"  # a slot checkpoint's optimizer: its parameters' names, in the optimizer's order


class MegatronAdapterSlots(AdapterSlots):
    """`AdapterSlots` on megatron's LoRA wrappers (module docstring); `active`, `remove` and the RNG swap are the
    torch slots'."""

    def __init__(self, model: nn.Module):  # not super().__init__: that one walks the HF wrappers
        wrapped = lora_modules(model)
        unknown = [n for n, m in wrapped.items() if not isinstance(m, (_ParallelLoRA, LoRARouter))]
        if unknown:  # every wrapper apply_lora makes is one of these: a new kind needs its slot draw below
            raise ValueError(f"multi-LoRA on the megatron backend: no adapter slot for the LoRA wrappers {unknown[:3]}")
        self.model = model
        self.modules = cast(Any, wrapped)  # the attribute swap reads the same names off a MegatronLoRA
        # the wrappers' own factors: the shapes and parallel marks a slot's copy, and what a cleared slot leaves
        self.own: dict[str, tuple[nn.Parameter, nn.Parameter]] = {
            n: (cast(nn.Parameter, m.lora_A.weight), cast(nn.Parameter, m.lora_B.weight)) for n, m in wrapped.items()}
        # the job's rank from the factors' rows: a wrapper's `rank` is the last active slot's
        self.max_rank = max(a.shape[0] for a, _ in self.own.values())
        self.slots: dict[str, Slot] = {}
        self.current: str | None = None
        self._off()

    def add(self, name: str, rank: int, alpha: float, seed: int) -> Slot:
        if name in self.slots:
            raise ValueError(f"adapter {name} already holds a slot")
        if rank > self.max_rank:
            raise ValueError(f"adapter {name}: rank {rank} exceeds the slots' rank {self.max_rank} (lora.rank)")
        factors = {}
        for mod_name, m in cast(dict[str, MegatronLoRA], self.modules).items():
            own_a, own_b = self.own[mod_name]
            # A whole on every TP rank: a column wrapper's, a router's (and an expert's: its TP group is of size 1)
            whole = isinstance(m, (LoRAColumnParallelLinear, LoRARouter)) or m.tp_size == 1
            in_full = own_a.shape[1] * (1 if whole else m.tp_size)  # a row wrapper's A is this rank's columns
            gen = torch.Generator().manual_seed(module_seed(seed, mod_name))
            bound = 1.0 / math.sqrt(in_full)  # PEFT's kaiming_uniform_(a=√5) on [r, in], as apply_lora draws it
            a_full = torch.empty(rank, in_full).uniform_(-bound, bound, generator=gen)
            a_local = a_full if whole else a_full.chunk(m.tp_size, dim=1)[m.tp_rank]
            a = nn.Parameter(a_local.to(own_a.device, own_a.dtype).contiguous())
            b = nn.Parameter(torch.zeros(own_b.shape[0], rank, device=own_b.device, dtype=own_b.dtype))
            for mine, theirs in ((a, own_a), (b, own_b)):
                for mark in PARALLEL_MARKS:
                    if hasattr(theirs, mark):
                        setattr(mine, mark, getattr(theirs, mark))
            factors[mod_name] = (a, b)
        slot = Slot(name, rank, alpha, factors, torch.Generator().manual_seed(seed + 1).get_state())
        self.slots[name] = slot
        return slot

    def remove(self, name: str) -> None:
        """Cleared: the wrappers let go of its factors (they point at their own again) and its gradients go."""
        slot = self.slots[name]
        super().remove(name)
        for mod_name, m in cast(dict[str, MegatronLoRA], self.modules).items():
            if m.lora_A.weight is slot.factors[mod_name][0]:
                m.lora_A.weight, m.lora_B.weight = self.own[mod_name]
        for p in slot.params:
            p.grad = None


class MegatronSlotSender(SlotSender, MegatronWeightSender):
    """`SlotSender` (the base once, then each adapter by name) with megatron's sources under HF names, gathered
    over TP and the pipeline stages; every rank calls it (the TP ranks other than the sender follow)."""

    def __init__(self, model: nn.Module, layout: Any, cfg: Any, transport: Any, trainer_group: Any = None):
        if getattr(transport, "kind", None) == "follower":  # the single-adapter sender's: found again below
            transport = None
        super().__init__(model, layout, cfg, transport, trainer_group=trainer_group)

    def publish(self, name: str, version: int, config: dict[str, Any]) -> SyncReport:
        self._adapter_src = None  # each slot its own rank: its tensors' shapes are planned per push
        return super().publish(name, version, config)


class MegatronMultiLoRATrainer(MultiLoRATrainer):
    """The slot trainer (backends/multi_lora_api.MultiLoRA) on a MegatronBackend; every call on every rank."""

    def __init__(self, backend: MegatronBackend, shard_optimizer: bool = True):
        # not super().__init__: that one wraps an HF model
        self.backend = self.mg = backend
        self.slots = MegatronAdapterSlots(backend.model)
        self.adapters = {}
        self.shard_optimizer = shard_optimizer  # False: every data-parallel rank holds the slot's whole AdamW state

    # ---- the hooks of the shared step ------------------------------------------------------------------

    def _forward_backward(self) -> ForwardBackward:
        b = self.mg
        return pipeline_forward_backward(b.model, b.pad_id) if b.stages.size > 1 else one_by_one(b._token_logp)

    def _clip(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        return clip_grad_norm(params, max_norm)

    def _adapter_off(self) -> AbstractContextManager[None]:
        return adapter_disabled(self.mg.model)

    def _optimizer(self, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
        """At data > 1 the slot's AdamW state split over the ranks that hold the same factors (sharded_adamw.py)."""
        dp = self._optimizer_ranks(params)
        if self.shard_optimizer and dp is not None:
            return ShardedAdamW(params, lr, dp)
        return super()._optimizer(params, lr)

    def _optimizer_ranks(self, params: list[torch.nn.Parameter]) -> DataParallel | None:
        """The ranks whose copies of `params` are alike (None: this rank alone). The data-parallel group, but for
        a slot with expert factors at expert > 1, where the data-parallel ranks hold different experts: then its
        expert-data-parallel group (the ranks holding the same experts and, at tensor 1, the same dense factors;
        at tensor > 1 it holds the TP peers, whose shards differ: the slot's AdamW stays whole)."""
        from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

        dp = self.mg.dp
        experts = any(getattr(p, "expert_parallel", False) for p in params)
        if not experts or parallel_state.get_expert_model_parallel_world_size() == 1:
            return dp if dp.size > 1 and dp.group is not None else None
        edp = parallel_state.get_expert_data_parallel_group()
        if parallel_state.get_tensor_model_parallel_world_size() > 1 or edp.size() == 1:
            return None
        return DataParallel(edp.rank(), edp.size(), WeightUpdateGroup.wrap(edp))

    def _data_parallel(self, slot: Slot) -> DataParallel:
        """The backend's groups with the slot's own factors as the sequence-parallel ones (summed over TP too) and
        as the expert ones (summed over the expert-data-parallel group instead of the data-parallel one, where the
        backend has such a group: expert parallelism, or sequence parallelism on an MoE model)."""
        dp = self.mg.dp
        experts = frozenset(id(p) for name, (a, b) in slot.factors.items() if is_expert_module(name) for p in (a, b))
        return replace(dp, sequence_params=frozenset(id(p) for p in slot.params
                                                     if getattr(p, "sequence_parallel", False)),
                       expert_params=experts if dp.expert_params else frozenset())

    def make_sender(self, transport: Any) -> SlotSender:
        b = self.mg
        return MegatronSlotSender(b.model, b.layout, b.cfg, transport, trainer_group=b.group)

    # ---- what leaves the trainer: gathered over TP and the stages --------------------------------------------

    def adapter_named(self, name: str) -> list[tuple[str, torch.Tensor]]:
        """Its factors under HF-PEFT names, whole (copies; a collective of every rank)."""
        with self.slots.active(name):
            tensors, _, _ = self.mg.peft_export()
        return [(n, t.detach().clone()) for n, t in tensors.items()]  # unsplit, the export's are the live factors

    def peft_config(self, name: str) -> dict[str, Any]:
        s = self.adapters[name].settings
        spec = self.mg.cfg.lora.model_copy(update={"rank": s.rank, "alpha": s.alpha})
        return peft_config(self.mg.model, spec, str(Path(self.mg.cfg.model.path).resolve()),
                           all_lora_modules(self.mg.model))

    def state(self, name: str) -> dict[str, Any]:
        """Its factors and AdamW state whole, in megatron's one-rank layout and names (tp_checkpoint.py), its step
        and its dropout stream (rank 0's); a collective."""
        a = self.adapters[name]
        local = _named(a.slot)
        optimizer: dict[str, Any] = a.optimizer.state_dict()
        shards = TensorShards.of(a.slot.params)
        if shards is not None:
            local, optimizer, _ = shards.gather(local, optimizer, {})
        return {"tensors": {n: t.detach().cpu().clone() for n, t in local},
                "optimizer": {**optimizer, NAMES: [n for n, _ in local]}, "step": a.step, "rng": a.slot.rng.clone(),
                "schedule": None if a.schedule is None else schedule_fields(a.schedule)}

    def load_state(self, name: str, state: dict[str, Any]) -> None:
        """`state` (as `state` wrote it, at any TP / pipeline size) into its slot: this rank's shards."""
        a = self.adapters[name]
        optimizer = dict(state["optimizer"])
        names, mine = optimizer.pop(NAMES), [n for n, _ in _named(a.slot)]
        shards = TensorShards.of(a.slot.params)
        if shards is None:
            tensors, own = state["tensors"], select_state(optimizer, names, mine)
        else:
            tensors, own = shards.local(state["tensors"], names, optimizer, mine)
        with torch.no_grad():
            for n, p in zip(mine, a.slot.params, strict=True):
                p.copy_(tensors[n])
        a.optimizer.load_state_dict(own)
        a.step, a.slot.rng = int(state["step"]), state["rng"]
        self._restore_schedule(a, state)


def _named(slot: Slot) -> list[tuple[str, torch.Tensor]]:
    """This rank's factors of a slot under megatron's global names, in its optimizer's order (A, B per module)."""
    return [(f"{n}.lora_{w}.weight", p.detach()) for n, pair in slot.factors.items() for w, p in zip("AB", pair,
                                                                                                      strict=True)]
