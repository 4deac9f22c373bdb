"""The built-in reward of the diffusion toy: how close an image's colour is to the colour its prompt asks for.

The image is the final latent x_0 [C, H, W] (the toy has no VAE); its colour is the spatial mean of each channel
[C] (channel 0-2 read as RGB, 3 as a fourth "brightness" channel). The reward is the negative RMS distance to
the prompt's target colour: 0 is a perfect match, the untrained toy scores about -0.35. A real job names an
aesthetic / OCR-style scorer by dotted path instead (not built yet: docs/diffusion.md).
"""

from __future__ import annotations

import torch


def colour(images: torch.Tensor) -> torch.Tensor:
    """images [B, C, H, W] -> their colours [B, C] (the mean over each channel's pixels)."""
    return images.float().mean(dim=(2, 3))


def colour_reward(images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """images [B, C, H, W], targets [B, C] -> rewards [B] = -sqrt(mean_c (colour_c - target_c)^2)."""
    if targets.shape != images.shape[:2]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match images {tuple(images.shape)}: one target "
                         "colour [C] per image")
    return -(colour(images) - targets.float()).pow(2).mean(dim=1).sqrt()
