"""Training backends: torch (HF models + kora's LoRA; CPU and small GPU). megatron-core is GPU-only."""
