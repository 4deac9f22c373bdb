"""The megatron-core backend (GPU; CPU-tested over gloo, tests/megatron_cpu.py): Qwen3 dense GPTModel from an HF
checkpoint, tensor-parallel LoRA wrappers, GRPO steps, and conversion of base and adapter tensors to HF / SGLang
names for sync and export.

Modules (megatron-core is imported lazily inside functions, so every module imports without it):
- convert:  HF <-> megatron names and layouts (fused QKV, [gate; up], TP shards); pure torch.
- parallel: process group + megatron parallel_state set-up; TP gathers.
- model:    TransformerConfig / GPTModel (local layer spec) from an HF config; HF weight loading; HF export.
- lora:     LoRAColumnParallelLinear / LoRARowParallelLinear and apply_lora.
- export:   the adapter under HF-PEFT / SGLang names, loading it back, the HF-PEFT directory.
- pipeline: GRPO's forwards and backwards through megatron's 1F1B schedule (parallelism.pipeline > 1).
- moe:      Qwen3-MoE: config fields, per-stage layer specs, expert LoRA in PEFT's grouped layout (gathered over
            expert parallelism).
- backend:  MegatronBackend (the training actor) and token_logprobs.
See docs/megatron_backend.md.
"""

MEGATRON_CORE_VERSION = "0.19.2"  # the version the GPU tests ran against (GPU machine: Python 3.12, torch 2.11)


def megatron_available() -> bool:
    try:
        import megatron.core  # noqa: F401, PLC0415 - megatron-core is optional: this module imports without it
    except ImportError:
        return False
    return True
