"""A tensor-parallel megatron policy's training state as one checkpoint, and back (checkpoint/training.py).

Each TP rank holds a shard of every sharded LoRA factor (a column-parallel linear's B on rows, a row-parallel
one's A on columns; megatron's `partition_dim` says which) and AdamW moments of the same shapes. A checkpoint
holds each factor whole in the one-rank layout, written once by global rank 0 (the data-parallel replicas hold the
same state): the shards concatenated along that dim, except a gated MLP's linear_fc1 B, whose shard is
[gate_t; up_t] (`partition_stride` 2: the LoRA wrapper marks it), so its shards' gate halves go first, then their up
halves, as [gate; up] is at one rank. Resuming splits each factor for this job's TP size, so a checkpoint resumes
at any `parallelism.tensor` (meta `tp_layout` "whole"; an older checkpoint, written as the shards concatenated,
resumes at its own TP size only, refused otherwise with the fix). Every rank's RNG state goes in too (`ranks`, in global
rank order): with lora.dropout > 0 each rank draws its own masks, and a resumed rank continues its own stream.

Pipeline stages each hold their own layers' factors, and expert-parallel ranks their own experts' (named by global
layer and expert index: model.py `global_name`): the writer gathers every expert-parallel rank's, then every
stage's, each name once, with the AdamW state renumbered to that order, so the checkpoint is the one-process
policy's and resumes at any `parallelism.pipeline` and `parallelism.expert` (each rank takes its own names back out,
by name: `select_state`).

Every function here that gathers is a collective: every rank of the world calls it, in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kora_trainer.checkpoint.lora_only import select_state

Named = tuple[str, torch.Tensor]
RNG_RANKS = "ranks"


Split = tuple[int, int] | None  # (dim, stride) of a TP-sharded tensor; None: every TP rank holds it whole


def shard_split(p: torch.Tensor) -> Split:
    """How megatron split this parameter over the TP group: its dim, and its stride (2: [gate_t; up_t] shards)."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    return int(getattr(p, "partition_dim", 0)), int(getattr(p, "partition_stride", 1))


def split_shard(full: torch.Tensor, split: Split, rank: int, size: int) -> torch.Tensor:
    """TP rank `rank`'s shard of a checkpointed tensor in the one-rank layout (the whole tensor when not sharded):
    with stride k, the rank's chunk of each of the k parts, concatenated."""
    if split is None or size == 1:
        return full
    dim, stride = split
    if full.shape[dim] % (size * stride):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} does not split into {size} shards on dim {dim}")
    return torch.cat([part.chunk(size, dim=dim)[rank] for part in full.chunk(stride, dim=dim)], dim=dim).contiguous()


def join_shards(shards: list[torch.Tensor], split: Split) -> torch.Tensor:
    """The TP ranks' shards as the one-rank tensor (`split_shard`'s inverse)."""
    if split is None:
        return shards[0]
    dim, stride = split
    parts = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([p[k] for k in range(stride) for p in parts], dim=dim)


@dataclass(frozen=True)
class TensorShards:
    """How this rank's adapter parameters (in the optimizer's order) split over its TP group, and which pipeline
    stage holds them."""

    rank: int  # TP rank
    size: int  # TP size
    dims: tuple[Split, ...]  # per parameter: how it is split (dim, stride), or None
    group: Any  # megatron's TP process group
    stages: int = 1  # pipeline size
    stage_group: Any = None  # megatron's pipeline group (stages > 1)
    experts: int = 1  # expert-parallel size
    expert_group: Any = None  # megatron's expert-parallel group (experts > 1)

    @classmethod
    def of(cls, params: list[torch.nn.Parameter]) -> TensorShards | None:
        """None at TP = 1, one stage and no expert parallelism: the checkpoint is this rank's state as it is."""
        from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

        size = parallel_state.get_tensor_model_parallel_world_size()
        stages = parallel_state.get_pipeline_model_parallel_world_size()
        experts = parallel_state.get_expert_model_parallel_world_size()
        if size == 1 and stages == 1 and experts == 1:
            return None
        return cls(parallel_state.get_tensor_model_parallel_rank(), size, tuple(shard_split(p) for p in params),
                   parallel_state.get_tensor_model_parallel_group(), stages,
                   parallel_state.get_pipeline_model_parallel_group() if stages > 1 else None, experts,
                   parallel_state.get_expert_model_parallel_group() if experts > 1 else None)

    def _joined(self) -> list[tuple[int, Any]]:
        return [(n, g) for n, g in ((self.experts, self.expert_group), (self.stages, self.stage_group)) if n > 1]

    def all_names(self, mine: list[str]) -> list[str]:
        """Every expert-parallel rank's and stage's parameter names, each once, in rank order (`mine` alone
        without either; a collective)."""
        names = mine
        for size, group in self._joined():
            parts: list[Any] = [None] * size
            dist.all_gather_object(parts, names, group=group)
            names = list(dict.fromkeys(n for part in parts for n in part))
        return names

    @staticmethod
    def _join(adapter: list[Named], optimizer: Mapping[str, Any], size: int, group: Any
              ) -> tuple[list[Named], dict[str, Any]]:
        """Every rank of `group`'s factors and AdamW state, each name once (the first rank's: the others hold a
        replica of a name they share), in rank order, the state renumbered to that order."""
        if len(optimizer["param_groups"]) != 1:
            raise ValueError("a pipeline or expert-parallel checkpoint joins one optimizer parameter group per rank")
        cpu = {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
               for i, st in optimizer["state"].items()}
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, ([(n, t.cpu()) for n, t in adapter], cpu), group=group)
        joined: list[Named] = []
        seen: set[str] = set()
        state: dict[int, Any] = {}
        for named, part_state in parts:
            for i, (n, t) in enumerate(named):
                if n in seen:
                    continue
                seen.add(n)
                if i in part_state:
                    state[len(joined)] = part_state[i]
                joined.append((n, t))
        group_0 = {**optimizer["param_groups"][0], "params": list(range(len(joined)))}
        return joined, {**optimizer, "state": state, "param_groups": [group_0]}

    def _gather(self, t: torch.Tensor, split: Split) -> torch.Tensor:
        if split is None:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return join_shards(parts, split)

    def gather(self, adapter: list[Named], optimizer: Mapping[str, Any], rng: Mapping[str, Any]
               ) -> tuple[list[Named], dict[str, Any], dict[str, Any]]:
        """The TP group's adapter and AdamW state, whole, and every rank's RNG (a collective of the world)."""
        if len(adapter) != len(self.dims):
            raise ValueError(f"{len(adapter)} adapter tensors but {len(self.dims)} parameters were planned")
        whole = [(n, self._gather(t, d)) for (n, t), d in zip(adapter, self.dims, strict=True)]
        state = {i: {k: self._gather(v, self.dims[i]) if _moment(v, adapter[i][1]) else v for k, v in s.items()}
                 for i, s in optimizer["state"].items()}
        joined: dict[str, Any] = {**optimizer, "state": state}
        for size, group in self._joined():  # the expert-parallel ranks' experts, then the stages' layers
            whole, joined = self._join(whole, joined, size, group)
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, dict(rng))
        return whole, joined, {**rng, RNG_RANKS: ranks}

    def local(self, adapter: Mapping[str, torch.Tensor], names: list[str], optimizer: Mapping[str, Any],
              mine: list[str] | None = None, whole: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """This rank's shards of a checkpoint `gather` wrote (`names`: the checkpoint's parameters in the
        optimizer's order; `mine`: this stage's, in its optimizer's order — all of `names` with one stage).
        `whole` False: an older checkpoint, its shards only concatenated (split the same way: same TP size)."""
        mine = names if mine is None else mine
        own = select_state(optimizer, names, mine)
        dims = self.dims if whole else tuple(None if d is None else (d[0], 1) for d in self.dims)
        shards = {n: split_shard(adapter[n], d, self.rank, self.size) for n, d in zip(mine, dims, strict=True)}
        state = {i: {k: split_shard(v, dims[i], self.rank, self.size) if _moment(v, adapter[mine[i]]) else v
                     for k, v in s.items()} for i, s in own["state"].items()}
        return shards, {**own, "state": state}

    @staticmethod
    def own_rng(rng: Mapping[str, Any]) -> Mapping[str, Any]:
        """This rank's own RNG state from a checkpoint's (rank 0's where the checkpoint was written by a world
        of another size)."""
        ranks = rng.get(RNG_RANKS)
        if isinstance(ranks, list) and len(ranks) == dist.get_world_size():
            return dict(ranks[dist.get_rank()])
        return rng


def _moment(value: Any, param: torch.Tensor) -> bool:
    """An AdamW moment of `param` (its shape), not the step counter."""
    return isinstance(value, torch.Tensor) and value.shape == param.shape

