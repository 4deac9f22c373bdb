"""A tiny random Qwen3ForCausalLM and its tokenizer, written to disk for tests.

Tests load models the way production does (`from_pretrained` on a directory), so this module
saves a real checkpoint (config.json + model.safetensors) and a real tokenizer
(tokenizer.json + tokenizer_config.json) rather than handing objects around. The vocabulary is
the toy task's: the ten digits, `+`, `=`, and the special tokens pad, bos, eos (15 tokens; the
model's embedding has `vocab` >= 15 rows, the rest unused).
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<eos>")
SYMBOLS = (*"0123456789", "+", "=")
TOKENS = (*SPECIALS, *SYMBOLS)  # id = position: pad 0, bos 1, eos 2, '0' 3 … '9' 12, '+' 13, '=' 14
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def make_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """A character-level WordLevel tokenizer: every digit/symbol is one token, bos is prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TOKENS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    # split into single characters (and drop whitespace) so "12+34=" -> 1 2 + 3 4 =
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Split("", behavior="isolated")])
    tok.decoder = decoders.Fuse()  # join tokens without spaces: "1 2" decodes to "12"
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<pad>",
        clean_up_tokenization_spaces=False)


def make_tiny_model(dir: str | Path, seed: int = 0, vocab: int = 16, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate: int = 128) -> Path:
    """Write a randomly initialised Qwen3ForCausalLM (float32) plus tokenizer to `dir`; returns its path."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    if vocab < len(TOKENS):
        raise ValueError(f"vocab must hold the {len(TOKENS)} toy tokens")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=hidden // heads, intermediate_size=intermediate,
        max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # from_config's init is small (std 0.02); widen it so random models give varied, non-flat logits
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return _save(model, out)


def tiny_moe_config(norm_topk_prob: bool = True, **kw):
    """A tiny Qwen3MoeConfig: 3 layers (layer 1 dense via `mlp_only_layers`), hidden 64, 4 heads / 2 KV heads, 8
    experts top-2, moe_intermediate_size 32, dense intermediate_size 96, vocab 32; `kw` overrides any field."""
    from transformers import Qwen3MoeConfig

    args = dict(vocab_size=32, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[1],
                max_position_embeddings=256, tie_word_embeddings=False, router_aux_loss_coef=0.0, dtype="float32")
    args.update(kw)
    return Qwen3MoeConfig(**args)


def tiny_moe_model(cfg, seed: int = 0):
    """Qwen3MoeForCausalLM of `cfg`, float32, randomly initialised wider than from_config's std 0.02: varied
    logits and well separated router scores."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model.eval()


def make_tiny_moe(dst: Path, norm_topk_prob: bool, seed: int = 0, **kw) -> Path:
    """`tiny_moe_model` of `tiny_moe_config(norm_topk_prob, **kw)` saved to `dst` (weights and config only)."""
    tiny_moe_model(tiny_moe_config(norm_topk_prob, **kw), seed).save_pretrained(dst, safe_serialization=True)
    return dst


def make_tiny_moe_model(dir: str | Path, seed: int = 0, vocab: int = 16, hidden: int = 64, layers: int = 3,
                        experts: int = 8, top_k: int = 2, moe_intermediate: int = 32, dense_layers: tuple = (1,)
                        ) -> Path:
    """A randomly initialised Qwen3MoeForCausalLM (float32; layers in `dense_layers` keep a dense MLP) plus the
    toy tokenizer in `dir`: what transformers 5 holds as fused 3-D experts and a bare router weight."""
    config = tiny_moe_config(
        True, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, head_dim=hidden // 4,
        intermediate_size=2 * hidden, moe_intermediate_size=moe_intermediate, num_experts=experts,
        num_experts_per_tok=top_k, mlp_only_layers=list(dense_layers), pad_token_id=PAD_ID, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID)
    return _save(tiny_moe_model(config, seed), Path(dir))


def _save(model, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer().save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys

    print(make_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kora-tiny"))
