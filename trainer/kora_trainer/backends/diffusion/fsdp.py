"""FSDP2 for the diffusion actor: the transformer sharded over the data-parallel ranks (`fully_shard` on a device
mesh: gloo on CPU, NCCL on GPU), each rank training on its share of a step's prompt groups.

How a step splits: its B = prompts x G samples go to the ranks in whole prompt groups, contiguous (rank r takes
groups r*n .. (r+1)*n - 1; with several optimizer steps a step, that share of each step's groups: rank_rows), and
the group-relative advantages are the whole batch's (the train command's driver computes them). Each rank's loss is
the mean over its own (sample, denoising step) terms (train_loop.update normalises by its rows), and FSDP2
averages the gradients over the ranks in its reduce-scatter; with equal shares the mean of the ranks' means is
the whole batch's mean, so the update is the one-rank update of the whole batch, up to the order of float sums
(tests/unit/test_diffusion_fsdp.py measures the difference). Gradient clipping and AdamW act on the sharded
parameters (DTensors): clip_grad_norm_ reduces the norm across the shards, each rank steps its own shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from kora_trainer.lora.model import adapter_pairs


def shard_transformer(transformer: nn.Module, mesh: Any) -> None:
    """One FSDP unit per transformer block, then the root (the embeddings and the output layers): a block's
    parameters are gathered for its forward and freed after, so a rank holds one block whole at a time."""
    for block in transformer.transformer_blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(transformer, mesh=mesh)


def rank_rows(batch: int, group: int, rank: int, world: int, minibatches: int = 1) -> torch.Tensor:
    """The sample rows (of B, a prompt's `group` samples adjacent) that `rank` of `world` trains on: in each of the
    step's `minibatches` optimizer steps (contiguous slices of B, as train_loop.update cuts them) its contiguous
    share of that minibatch's prompt groups, in minibatch order, so that the rank's k-th minibatch of its own rows
    is its share of the batch's k-th and the ranks' k-th optimizer step is the one-rank run's."""
    groups, per_step = batch // group, batch // minibatches
    if batch % group or groups % world:
        raise ValueError(f"algorithm.rolloutBatchSize {groups} prompt groups do not split evenly over "
                         f"parallelism.data {world} ranks: make rolloutBatchSize a multiple of {world}")
    if batch % minibatches or per_step % (group * world):
        raise ValueError(f"algorithm.globalBatchSize {per_step} samples per optimizer step do not split into whole "
                         f"prompt groups of {group} over parallelism.data {world} ranks: make globalBatchSize a "
                         f"multiple of nSamplesPerPrompt x parallelism.data = {group * world}")
    per = per_step // world
    return torch.cat([torch.arange(k * per_step + rank * per, k * per_step + (rank + 1) * per)
                      for k in range(minibatches)])


def full_adapter(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's A/B factors whole (PEFT names), gathered from the shards: every rank must call it."""
    out: dict[str, torch.Tensor] = {}
    for pair in adapter_pairs(model):
        for name, t in pair:
            full = t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor shard, or a plain tensor
            out[name] = full.detach().clone()
    return out


def load_full_adapter(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy whole A/B factors (PEFT names, as full_adapter gives them) into the model: a sharded factor takes its
    own shard of the whole one (no communication: every rank holds the whole tensors)."""
    with torch.no_grad():
        for pair in adapter_pairs(model):
            for name, t in pair:
                if isinstance(t, DTensor):
                    t.to_local().copy_(distribute_tensor(tensors[name], t.device_mesh, t.placements,
                                                         src_data_rank=None).to_local())
                else:
                    t.copy_(tensors[name])


def full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state whole, keyed by parameter name (torch.distributed.checkpoint's full state dict):
    the same for a sharded model on any number of ranks as for the plain one, so a checkpoint resumes at any
    rank count. Every rank must call it (it gathers the shards)."""
    state: dict[str, Any] = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return state


def load_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """full_optimizer_state's dict into `opt` (each rank keeps its own shard of it). Call it before the
    parameters have gradients: torch's loader initialises the optimizer's state with one zero step first."""
    set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))
