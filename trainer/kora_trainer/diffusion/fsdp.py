"""FSDP2 for the diffusion actor: the transformer sharded over the data-parallel ranks (`fully_shard` on a device
mesh: gloo on CPU, NCCL on GPU), each rank training on its share of a step's prompt groups.

How a step splits: its B = prompts x G samples go to the ranks in whole prompt groups, contiguous (rank r takes
groups r*n .. (r+1)*n - 1), so each rank's group-relative advantages are the whole batch's. Each rank's loss is
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

from kora_trainer.lora.model import adapter_pairs


def shard_transformer(transformer: nn.Module, mesh: Any) -> None:
    """One FSDP unit per transformer block, then the root (the embeddings and the output layers): a block's
    parameters are gathered for its forward and freed after, so a rank holds one block whole at a time."""
    from torch.distributed.fsdp import fully_shard

    for block in transformer.transformer_blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(transformer, mesh=mesh)


def rank_rows(batch: int, group: int, rank: int, world: int) -> torch.Tensor:
    """The sample rows (of B, a prompt's `group` samples adjacent) that `rank` of `world` trains on."""
    groups = batch // group
    if batch % group or groups % world:
        raise ValueError(f"algorithm.rolloutBatchSize {groups} prompt groups do not split evenly over "
                         f"parallelism.data {world} ranks: make rolloutBatchSize a multiple of {world}")
    per = groups // world * group
    return torch.arange(rank * per, (rank + 1) * per)


def full_adapter(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's A/B factors whole (PEFT names), gathered from the shards: every rank must call it."""
    out: dict[str, torch.Tensor] = {}
    for pair in adapter_pairs(model):
        for name, t in pair:
            full = t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor shard, or a plain tensor
            out[name] = full.detach().clone()
    return out
