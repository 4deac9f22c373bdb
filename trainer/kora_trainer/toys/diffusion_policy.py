"""The toy's policy as Flow-GRPO sees it: a velocity function per batch of samples, and per-sample noise streams."""

from __future__ import annotations

import torch

from kora_trainer.algorithm.flow_grpo import VelocityFn
from kora_trainer.toys.diffusion import DiffusionToy


def velocity_fn(toy: DiffusionToy, prompt_ids: torch.Tensor, rows: slice | torch.Tensor | None = None,
                guidance: float = 1.0) -> VelocityFn:
    """The policy's velocity for these samples: the transformer conditioned on each sample's prompt embedding.

    guidance > 1: classifier-free guidance, v = v_uncond + g (v_cond - v_uncond), with v_uncond the same model
    on the toy's unconditional embedding — one forward of the doubled batch, as diffusers' SD3 pipeline and
    flow_grpo's sampler and trainer do; the SDE step's Gaussian is then built on the guided velocity on both sides.
    """
    ids = prompt_ids if rows is None else prompt_ids[rows]
    enc, pooled = toy.encoder_hidden_states[ids], toy.pooled_projections[ids]  # [B, L, D], [B, Dp]
    if guidance != 1.0:
        if toy.negative is None:
            raise ValueError("diffusion.guidanceScale > 1 needs the model's unconditional embedding "
                             "(prompt_embeds.safetensors: negative_*): remake the toy with `kora make-toy --diffusion`")
        b = enc.shape[0]
        enc = torch.cat([toy.negative[0].expand(b, -1, -1), enc])  # [2B, L, D]: unconditional rows first
        pooled = torch.cat([toy.negative[1].expand(b, -1), pooled])  # [2B, Dp]

    def velocity(latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        if guidance == 1.0:
            out: torch.Tensor = toy.transformer(hidden_states=latents, encoder_hidden_states=enc,
                                                pooled_projections=pooled, timestep=timestep, return_dict=False)[0]
            return out
        both = toy.transformer(hidden_states=torch.cat([latents, latents]), encoder_hidden_states=enc,
                               pooled_projections=pooled, timestep=torch.cat([timestep, timestep]),
                               return_dict=False)[0]  # [2B, C, H, W]
        uncond, cond = both.chunk(2)
        guided: torch.Tensor = uncond + guidance * (cond - uncond)
        return guided

    return velocity


def generators(seed: int, step: int, n: int) -> list[torch.Generator]:
    """Sample i of step `step`: its own stream, so any sample can be re-drawn alone."""
    return [torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + i) for i in range(n)]
