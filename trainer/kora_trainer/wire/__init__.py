"""What the trainer and the engines both speak: the SGLang HTTP client (`engine_client`), the bucket protocol
(`protocol`), the weight-update process group (`group`), tensor payloads (`serialize`), LoRA tensor names
(`lora_names`) and the engine side of the GPU fast path (`fast_receive`). Imports nothing of kora's above it:
the sender (`sync/`) and the reference engine (`kora_engine/lm/`) both build on it, never on each other."""
