"""A tiny Qwen3.5-style hybrid model (transformers 5's Qwen3_5ForCausalLM: GDN linear-attention layers and a full
attention layer) written to disk with the toy tokenizer, and the GDN test helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tinymodel import BOS_ID, EOS_ID, PAD_ID, _save

GDN_TARGETS = "[linear_qkv,linear_proj,in_proj,out_proj]"


def make_tiny_gdn_model(dir: str | Path, seed: int = 0, vocab: int = 16, hidden: int = 64,
                        layer_types: tuple[str, ...] = ("linear_attention", "full_attention", "linear_attention")
                        ) -> Path:
    """A randomly initialised Qwen3_5ForCausalLM (float32) + the toy tokenizer in `dir`: each GDN layer has
    in_proj_qkv [2·32 + 64, 64], in_proj_z [64, 64], in_proj_b / in_proj_a [4, 64] and out_proj [64, 64]."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, intermediate_size=2 * hidden,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=PAD_ID,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # widen the init (as tinymodel does): varied, non-flat logits
        for name, p in model.named_parameters():
            if p.dim() > 1 and "conv1d" not in name:
                p.normal_(0.0, 0.2)
    return _save(model, Path(dir))


def randomize_adapter(backend: Any, seed: int, scale: float = 0.1) -> None:
    """A trained-looking adapter (B != 0) on a TorchBackend, the way training leaves it: rows the backend pinned
    (GDN gates in Adapter mode) stay zero, as their zero gradient keeps them."""
    import torch

    from kora_trainer.lora.gdn import pin_gate_rows

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in backend.params:
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    if backend.gate_pinned:
        pin_gate_rows(backend.model)


def make_tiny_gdn_moe_model(dir: str | Path, seed: int = 0, vocab: int = 16, hidden: int = 64, experts: int = 4,
                            layer_types: tuple[str, ...] = ("linear_attention", "full_attention")) -> Path:
    """A randomly initialised Qwen3_5MoeForCausalLM (text-only; float32) + the toy tokenizer in `dir`: GDN and
    attention layers whose MLP is transformers 5's fused 3-D experts, a bare router weight and a shared expert."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=experts, num_experts_per_tok=2,
        router_aux_loss_coef=0.0, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=PAD_ID,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "conv1d" not in name:
                p.normal_(0.0, 0.2)
    return _save(model, Path(dir))
