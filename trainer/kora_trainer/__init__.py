"""kora trainer: LoRA GRPO with weight sync to rollout engines. Importing this package is cheap."""
