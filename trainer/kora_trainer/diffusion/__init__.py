"""Diffusion-model LoRA RL (issue 23): Flow-GRPO on a diffusers transformer.

Modules, bottom up:
  toy.py        the tiny diffusion toy made on disk (`kora make-toy --diffusion DIR`), loaded back with diffusers
  rewards.py    the built-in per-prompt colour reward on the final latent "image"
  flow_grpo.py  the pure math: the SDE step, its per-step Gaussian log-prob, rollouts, the re-score, the loss
  lora.py       PEFT LoRA on the transformer's attention projections (SD3 joint blocks' names)
  train_loop.py a single-process CPU training loop (rollout -> reward -> re-score -> update)
See docs/diffusion.md for the math and what is not built yet.
"""
