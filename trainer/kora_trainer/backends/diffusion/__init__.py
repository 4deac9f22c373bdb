"""The diffusion actor (issue 23): Flow-GRPO on a diffusers transformer, one rank or FSDP2 over N.

Here: actor.py (the policy a driver or a Ray rank holds: load, adapt, step, sync, export), fsdp.py (FSDP2
sharding of the transformer and the full adapter/optimizer state), train_loop.py (rollout -> reward ->
re-score -> update, and the single-process CPU loop). The rest of diffusion lives in the layers beside the
language-model path, bottom up:
  algorithm/flow_grpo.py, algorithm/diffusion_rewards.py   the SDE step, its log-prob, the loss; the colour reward
  lora/diffusers.py              LoRA on the transformer's attention projections under PEFT's names
  checkpoint/diffusers_export.py the diffusers-loadable export
  wire/diffusion.py, wire/diffusion_lora.py, wire/diffusion_client.py   the engine's protocol, the LoRA push's
                                 payload (pair buckets, names, the fold), the trainer's HTTP client
  toys/diffusion.py, toys/diffusion_policy.py   the toy on disk; its velocity function, per-sample noise streams
  engine/kora_engine/diffusion/  the reference diffusion engine (a server process of its own)
See docs/diffusion.md for the math, the measured numbers and what is not built yet.
"""
