"""The diffusion toy: a tiny SD3 transformer on 8x8 four-channel latents, small enough to RL-train on 2 CPU cores.

`kora make-toy --diffusion DIR` writes, each part loadable by diffusers' own `from_pretrained`:
  DIR/transformer/          SD3Transformer2DModel (config.json + diffusion_pytorch_model.safetensors), random init:
                            2 joint blocks, 4 heads x 16, patch 2 (16 image tokens), 285k parameters
  DIR/scheduler/            FlowMatchEulerDiscreteScheduler (scheduler_config.json), shift 3 as SD3's
  DIR/prompt_embeds.safetensors  the "text encoder": a fixed random embedding per prompt id
                            (encoder_hidden_states [P, 4, 32], pooled_projections [P, 32]) and one unconditional
                            embedding for classifier-free guidance (negative_*: [1, 4, 32], [1, 32])
  DIR/prompts.jsonl         {"prompt_id", "prompt", "target"}: the colour (one value per latent channel) the
                            built-in reward wants the prompt's image to have (rewards.colour_reward)
  DIR/toy.json              how it was made
There is no VAE and no text encoder: the "image" is the final latent itself. The transformer is not pretrained:
its random velocity field already gives images whose colours vary from sample to sample (the SDE's noise and
the initial latent), which is all GRPO needs to have a signal; the policy must learn to steer each prompt's
images towards that prompt's colour. Patch 2 rather than 1: 4x fewer tokens, ~3x faster on CPU (measured:
10 forwards of 64 samples 0.21 s against 0.45 s for a patch-1 model of the same width).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

KIND = "diffusion-toy"  # toy.json's "kind": what tells a diffusion toy from the LLM toy (kora_trainer/toys/lm.py)
TRANSFORMER = {
    "sample_size": 8, "patch_size": 2, "in_channels": 4, "out_channels": 4, "num_layers": 2,
    "attention_head_dim": 16, "num_attention_heads": 4,
    "joint_attention_dim": 32, "caption_projection_dim": 64,  # caption_projection_dim = heads x head dim (SD3's rule)
    "pooled_projection_dim": 32, "pos_embed_max_size": 8,
}
# SD3-medium's transformer (stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json: 24 joint blocks
# of 24 heads x 64, 16 latent channels, 2.03B parameters), random init: the realistic shape the GPU bench pushes
# (bench/diffusion_gpu.py). Its sample_size is set when the toy is made (the latent side: push bytes do not depend
# on it, rollout time does).
SD3_MEDIUM = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
    "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048, "pos_embed_max_size": 192,
}
SHAPES = {"toy": TRANSFORMER, "sd3-medium": SD3_MEDIUM}
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
PROMPT_TOKENS = {"toy": 4, "sd3-medium": 77}  # the embedding table's tokens a prompt (CLIP's 77 for the SD3 shape)
NUM_PROMPTS = 16
TARGET_RANGE = 0.5  # targets uniform in [-0.5, 0.5] per channel: reachable from the base's colours (std ~0.1-0.2)
SEED = 0


@dataclass
class DiffusionToy:
    """A loaded toy: the model parts and the prompt table (row i = prompt id i)."""

    transformer: Any  # diffusers SD3Transformer2DModel
    scheduler: Any  # diffusers FlowMatchEulerDiscreteScheduler
    encoder_hidden_states: torch.Tensor  # [P, PROMPT_TOKENS, joint_attention_dim]
    pooled_projections: torch.Tensor  # [P, pooled_projection_dim]
    targets: torch.Tensor  # [P, C] the colour each prompt's image should have
    prompts: list[str]
    # the unconditional (empty negative prompt) embedding for classifier-free guidance: [1, L, D], [1, Dp]; None in
    # a toy made before guidance was built
    negative: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        cfg = self.transformer.config
        return int(cfg.in_channels), int(cfg.sample_size), int(cfg.sample_size)

    @property
    def device(self) -> torch.device:
        return self.encoder_hidden_states.device

    def to(self, device: str | torch.device) -> DiffusionToy:
        """Move the transformer and the prompt tables to `device` (in place; returns self). The targets stay on the
        CPU with the rewards."""
        self.transformer.to(device)
        self.encoder_hidden_states = self.encoder_hidden_states.to(device)
        self.pooled_projections = self.pooled_projections.to(device)
        if self.negative is not None:
            self.negative = (self.negative[0].to(device), self.negative[1].to(device))
        return self


def make_diffusion_toy(out_dir: str | Path, num_prompts: int = NUM_PROMPTS, seed: int = SEED, shape: str = "toy",
                       sample_size: int | None = None) -> dict[str, Any]:
    """Write the toy to `out_dir`; return what toy.json records. `shape`: the transformer's (SHAPES: the CPU toy,
    or SD3-medium's for a GPU); `sample_size`: the latent side, when not the shape's own."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel  # noqa: PLC0415 - the diffusion stack (diffusers) loads on use

    if shape not in SHAPES:
        raise ValueError(f"diffusion toy shape {shape!r}: one of {sorted(SHAPES)}")
    config = {**SHAPES[shape], **({"sample_size": sample_size} if sample_size else {})}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    # diffusers' lazy-import module makes mypy see a class without its mixins' methods: Any
    transformer: Any = SD3Transformer2DModel(**config)
    transformer.save_pretrained(out / "transformer")
    scheduler: Any = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    scheduler.save_pretrained(out / "scheduler")
    gen = torch.Generator().manual_seed(seed + 1)
    embeds = {
        "encoder_hidden_states": torch.randn(num_prompts, PROMPT_TOKENS[shape], config["joint_attention_dim"],
                                             generator=gen),
        "pooled_projections": torch.randn(num_prompts, config["pooled_projection_dim"], generator=gen),
    }
    targets = (torch.rand(num_prompts, config["in_channels"], generator=gen) * 2 - 1) * TARGET_RANGE
    # the unconditional embedding classifier-free guidance contrasts each prompt with (a real pipeline encodes the
    # empty negative prompt; drawn after the targets so the prompts and targets are those of toys made before it)
    embeds["negative_encoder_hidden_states"] = torch.randn(1, PROMPT_TOKENS[shape], config["joint_attention_dim"],
                                                           generator=gen)
    embeds["negative_pooled_projections"] = torch.randn(1, config["pooled_projection_dim"], generator=gen)
    save_file(embeds, str(out / "prompt_embeds.safetensors"))
    rows = [{"prompt_id": i, "prompt": f"colour-{i:02d}", "target": [round(float(v), 4) for v in targets[i]]}
            for i in range(num_prompts)]
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = {"kind": KIND, "params": sum(p.numel() for p in transformer.parameters()), "prompts": num_prompts,
            "seed": seed, "shape": shape, "transformer": config, "scheduler": SCHEDULER}
    (out / "toy.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def is_diffusion_toy(path: str | Path) -> bool:
    meta = Path(path) / "toy.json"
    return meta.is_file() and json.loads(meta.read_text()).get("kind") == KIND


def load_diffusion_toy(path: str | Path) -> DiffusionToy:
    """Load a toy through diffusers' own `from_pretrained` (the same code a real SD3 checkpoint goes through)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel  # noqa: PLC0415 - the diffusion stack (diffusers) loads on use

    root = Path(path)
    if not (root / "transformer" / "config.json").is_file():
        raise FileNotFoundError(f"{root} holds no transformer/config.json: make one with `kora make-toy --diffusion "
                                f"{root}`")
    transformer = SD3Transformer2DModel.from_pretrained(root / "transformer")
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler")
    embeds = load_file(str(root / "prompt_embeds.safetensors"))
    rows = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines() if line.strip()]
    if [r["prompt_id"] for r in rows] != list(range(len(rows))):
        raise ValueError(f"{root / 'prompts.jsonl'}: prompt_id must run 0..{len(rows) - 1} in order (row i = id i)")
    return DiffusionToy(transformer=transformer, scheduler=scheduler,
                        encoder_hidden_states=embeds["encoder_hidden_states"],
                        pooled_projections=embeds["pooled_projections"],
                        targets=torch.tensor([r["target"] for r in rows], dtype=torch.float32),
                        prompts=[r["prompt"] for r in rows],
                        negative=((embeds["negative_encoder_hidden_states"], embeds["negative_pooled_projections"])
                                  if "negative_encoder_hidden_states" in embeds else None))
