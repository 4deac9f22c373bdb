"""The toy's policy as Flow-GRPO sees it: a velocity function per batch of samples, and per-sample noise streams."""

from __future__ import annotations

import torch

from kora_trainer.diffusion.flow_grpo import VelocityFn
from kora_trainer.diffusion.toy import DiffusionToy


def velocity_fn(toy: DiffusionToy, prompt_ids: torch.Tensor, rows: slice | torch.Tensor | None = None
                ) -> VelocityFn:
    """The policy's velocity for these samples: the transformer conditioned on each sample's prompt embedding."""
    ids = prompt_ids if rows is None else prompt_ids[rows]
    enc, pooled = toy.encoder_hidden_states[ids], toy.pooled_projections[ids]  # [B, L, D], [B, Dp]

    def velocity(latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = toy.transformer(hidden_states=latents, encoder_hidden_states=enc,
                                            pooled_projections=pooled, timestep=timestep, return_dict=False)[0]
        return out

    return velocity


def generators(seed: int, step: int, n: int) -> list[torch.Generator]:
    """Sample i of step `step`: its own stream, so any sample can be re-drawn alone."""
    return [torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + i) for i in range(n)]
