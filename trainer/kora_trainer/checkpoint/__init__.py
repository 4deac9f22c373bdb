"""Checkpoints: LoRA-only resume, HF-PEFT export, and the streaming `kora merge` tool."""
