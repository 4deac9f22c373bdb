"""The reference diffusion engine for the toy (`python -m kora_engine.diffusion.server`): server.py (the routes),
stacked_fold.py (the lora_merge fold, a few launches per shape group)."""
