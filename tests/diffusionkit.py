"""Shared pieces of the diffusion tests (issue 23): a loaded toy with a LoRA that is not zero (the toy on disk is
conftest.py's `diffusion_toy_dir`)."""

from __future__ import annotations

import torch

from kora_trainer.lora.diffusers import SD3_TARGETS, apply_diffusion_lora
from kora_trainer.lora.model import lora_modules
from kora_trainer.toys.diffusion import DiffusionToy, load_diffusion_toy


def toy_with_moved_adapter(path, rank: int = 4, alpha: float = 8.0, seed: int = 7) -> DiffusionToy:
    """The toy with LoRA on SD3's targets and every B set to small random values, so the adapter changes the
    policy (a freshly made adapter has B = 0 and is the base exactly: a match there would prove less)."""
    torch.set_num_threads(1)
    toy = load_diffusion_toy(path)
    toy.transformer.eval()
    apply_diffusion_lora(toy.transformer, rank, alpha, SD3_TARGETS)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(toy.transformer).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.05)
    return toy
