"""Per-token log-probs of responses under an HF causal LM, two ways that give the same numbers.

- `sequence_logp`: each sample's prompt+response as one right-padded sequence (the plain way).
- `shared_prefix_logp`: GRPO samples G responses per prompt, so the prompt is forwarded ONCE per group
  and its KV cache (with its autograd graph) is fanned out to the G responses, which are then forwarded
  as continuations. With the toy's 7-token prompts and 4-token responses that is 32·7 + 256·4 tokens
  instead of 256·11 — half the FLOPs, forward and backward. Gradients are identical: the prompt's
  activations are shared by the G samples, so their gradients add up there, as they would in G copies.
  (LoRA dropout masks on prompt tokens are shared within a group — a different draw, same distribution.)

Both return [B, R] log-probs aligned with `Padded.response_ids` (0 where the mask is 0).

The KV cache keyword moved across transformers 5 releases: 5.24 takes `cache=` (`past_key_values` deprecated),
5.17 (the GPU image) takes only `past_key_values=` and silently drops an unknown `cache=` into **kwargs, which
made the continuation run without its prompt. `cache_kwarg` reads the model's forward signature instead.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from kora_trainer.backends.batch import Padded
from kora_trainer.wire.vision import forward_inputs, is_vision_language


def _gather(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [B, R, V], targets [B, R] -> log p(target) [B, R] (at the sampling temperature)."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, R, V]
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def sequence_logp(model: nn.Module, p: Padded, pad_id: int, temperature: float = 1.0) -> torch.Tensor:
    device = next(model.parameters()).device
    b, r = p.response_ids.shape
    lens = [len(x) for x in p.prompts]
    width = max(n + r for n in lens)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    for i, prompt in enumerate(p.prompts):
        n = lens[i]
        ids[i, :n] = torch.tensor(prompt, dtype=torch.long)
        ids[i, n:n + r] = p.response_ids[i]
        attn[i, :n] = 1
        attn[i, n:n + r] = p.response_mask[i].long()
    ids, attn = ids.to(device), attn.to(device)
    inputs: dict[str, object] = {"input_ids": ids}
    if any(im is not None for im in p.images):  # a VL batch: the images through the tower, multimodal RoPE
        image_token = int(getattr(model, "config").image_token_id)  # noqa: B009 (nn.Module types no config)
        inputs, _ = forward_inputs(model, ids, attn, p.images, image_token, lens)
    logits = model(attention_mask=attn, **inputs).logits  # [B, W, V]
    # response token j sits at position n+j and is predicted by the logits at n+j-1
    pos = torch.tensor(lens).unsqueeze(1) - 1 + torch.arange(r).unsqueeze(0)  # [B, R]
    picked = logits.gather(1, pos.to(device).unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [B, R, V]
    return _gather(picked, p.response_ids.to(device), temperature) * p.response_mask.to(device)


def cache_kwarg(model: nn.Module) -> str:
    """The name `model.forward` takes its KV cache under: `cache` (transformers >= 5.2x) or `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def prefix_shareable(model: nn.Module) -> bool:
    """Whether `shared_prefix_logp` can differentiate through this model's cache. Not for GDN / linear-attention
    layers: transformers 5 writes their recurrent state into the cache in place (cache_utils.py
    `LinearAttentionLayer.update_recurrent_state`: `copy_`), which the prompt's autograd graph still needs. Not for a
    vision-language model either: the continuation's positions here are 1-D text positions, and such a model needs
    its multimodal RoPE rows and the images (sequence_logp passes them)."""
    config = getattr(model, "config", None)
    if config is not None and is_vision_language(config):
        return False
    types = getattr(config, "layer_types", None) or []
    return "linear_attention" not in types


def shared_prefix_logp(model: nn.Module, p: Padded, pad_id: int, temperature: float = 1.0) -> torch.Tensor:
    from transformers import DynamicCache  # noqa: PLC0415 - transformers is heavy: loaded on use

    device = next(model.parameters()).device
    keys = [tuple(x) for x in p.prompts]
    uniq = list(dict.fromkeys(keys))
    owner = torch.tensor([uniq.index(k) for k in keys], device=device)  # [B] sample -> its prompt
    n_p, width = len(uniq), max(len(k) for k in uniq)
    # prompts LEFT-padded, so every prompt's last token is at column width-1 and responses line up after it
    p_ids = torch.full((n_p, width), pad_id, dtype=torch.long)
    p_mask = torch.zeros((n_p, width), dtype=torch.long)
    for i, k in enumerate(uniq):
        p_ids[i, width - len(k):] = torch.tensor(k, dtype=torch.long)
        p_mask[i, width - len(k):] = 1
    p_ids, p_mask = p_ids.to(device), p_mask.to(device)
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)  # [P, Wp] real positions 0..len-1
    cache = DynamicCache()
    kw = cache_kwarg(model)
    first = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True,
                  **{kw: cache}).logits[:, -1]  # [P, V] predicts response token 0
    logits = first.index_select(0, owner).unsqueeze(1)  # [B, 1, V]
    r = p.response_ids.shape[1]
    resp_ids, resp_mask = p.response_ids.to(device), p.response_mask.to(device)
    if r > 1:
        for layer in cache.layers:  # fan the prompt's KV out to its G samples (differentiable gather)
            # attention layers, filled by the prefill (the union also has linear-attention and dummy layers)
            layer.keys = layer.keys.index_select(0, owner)  # type: ignore[union-attr]  # [B, kv_heads, Wp, head_dim]
            layer.values = layer.values.index_select(0, owner)  # type: ignore[union-attr]
        inp = resp_ids[:, :-1]  # [B, R-1]: tokens 0..R-2 predict 1..R-1
        mask = torch.cat([p_mask.index_select(0, owner), resp_mask[:, :-1].long()], dim=1)  # [B, Wp+R-1]
        pos = p_mask.sum(-1).index_select(0, owner).unsqueeze(1) + torch.arange(r - 1, device=device)  # [B, R-1]
        rest = model(input_ids=inp, attention_mask=mask, position_ids=pos, use_cache=True,
                     **{kw: cache}).logits  # [B, R-1, V]
        logits = torch.cat([logits, rest], dim=1)  # [B, R, V]
    return _gather(logits, resp_ids, temperature) * resp_mask
