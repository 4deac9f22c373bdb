"""Diffusion-model LoRA RL (issue 23): Flow-GRPO on a diffusers transformer.

Modules, bottom up:
  toy.py        the tiny diffusion toy made on disk (`kora make-toy --diffusion DIR`), loaded back with diffusers
  rewards.py    the built-in per-prompt colour reward on the final latent "image"
  flow_grpo.py  the pure math: the SDE step, its per-step Gaussian log-prob, rollouts, the re-score, the loss
  policy.py     the toy's velocity function per batch of samples, per-sample noise streams
  lora.py       LoRA on the transformer's attention projections under PEFT's names (SD3 joint blocks' targets)
  lora_sync.py  LoRA IPC merge: PEFT -> sglang-diffusion names, pair-preserving buckets, the engine's fold
  train_loop.py a single-process CPU training loop (rollout -> reward -> re-score -> update)
  engine.py     a reference diffusion engine for the toy (sglang-diffusion's rollout and weight-update routes)
  engine_client.py  the trainer's side of it: rollouts over HTTP, the IPC-merge push after every update
See docs/diffusion.md for the math, the measured numbers and what is not built yet.
"""
