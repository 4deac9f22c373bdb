"""GRPO's forwards and backwards through megatron-core's pipeline schedule (parallelism.pipeline > 1).

Every stage of a pipeline holds the same step's batch and walks the same micro-batches (the same shuffle and DP
share), so the schedule's data iterator is built alike on each; the first stage embeds the ids, the others receive
the previous stage's activations (of any micro-batch length: `variable_seq_lengths`), and only the last stage turns
logits into response log-probs and the GRPO loss. The schedule (1F1B, `get_forward_backward_func`) runs the
backward of each micro-batch as soon as the pipeline allows and leaves the adapter gradients on each stage's own
parameters; the loss a micro-batch returns is used as is (`calculate_per_token_loss`: grpo_loss is already
normalised by the minibatch's tokens), so the gradients equal the one-stage step's.

No-grad log-probs (the KL reference, old log-probs at T != 1, `logprobs()`) run the same schedule forward-only and
are broadcast from the last stage, so every rank returns the same [B, R] numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch

from kora_trainer.backends.batch import Padded
from kora_trainer.backends.grpo_step import ForwardBackward, MicroLoss
from kora_trainer.backends.megatron.parallel import from_last_stage, is_last_stage


def packed(prompts: list[list[int]], response_ids: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, W], pos [B, R]): prompt+response right-padded into one sequence per sample, and the position
    whose logits predict each response token (response token j of sample i sits at len(prompt_i)+j)."""
    b, r = response_ids.shape
    lens = [len(x) for x in prompts]
    ids = torch.full((b, max(lens) + r), pad_id, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, :lens[i]] = torch.tensor(prompt, dtype=torch.long)
        ids[i, lens[i]:lens[i] + r] = response_ids[i]
    pos = torch.tensor(lens).unsqueeze(1) - 1 + torch.arange(r).unsqueeze(0)  # [B, R]
    return ids, pos


def sequence_multiple(model: torch.nn.Module) -> int:
    """What a sequence's length must be a multiple of: the TP size under sequence parallelism (each rank holds
    an equal share of the tokens between the layers), else 1."""
    config = getattr(model, "config", None)
    return int(config.tensor_model_parallel_size) if config is not None and config.sequence_parallel else 1


def padded_to(ids: torch.Tensor, multiple: int, pad_id: int = 0) -> torch.Tensor:
    """[B, L] ids right-padded to a multiple of `multiple` (causal attention: no real token sees the padding)."""
    extra = -ids.shape[1] % multiple
    return torch.nn.functional.pad(ids, (0, extra), value=pad_id) if extra else ids


def logits_logp(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Vocab-sharded logits [B, L, V/tp] of `ids` [B, L] -> [B, L-1] log p(token t+1 | tokens <= t), reduced over
    the TP group's vocab shards (the full [tokens, vocab] logits are never gathered)."""
    from megatron.core import tensor_parallel  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    # vocab_parallel_cross_entropy works in place on its input: hand it its own fp32 copy
    shifted = logits[:, :-1].to(torch.float32, copy=True)  # [B, L-1, V/tp]
    if temperature > 0 and temperature != 1.0:
        shifted = shifted / temperature
    loss = tensor_parallel.vocab_parallel_cross_entropy(shifted, ids[:, 1:].contiguous())  # megatron: untyped
    return -cast(torch.Tensor, loss)  # [B, L-1]


def run_pipeline(model: torch.nn.Module, p: Padded, mbs: list[torch.Tensor], pad_id: int, temperature: float,
                 loss_of: MicroLoss | None = None) -> list[torch.Tensor]:
    """Forward (and, given `loss_of`, backward) micro-batches `mbs` (sample indices into `p`) through the stages.
    Returns each micro-batch's [b, R] response log-probs on the last stage, [] on the others."""
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    if not mbs:
        return []
    device = next(model.parameters()).device
    multiple = sequence_multiple(model)
    inputs = [(mb, padded_to(ids, multiple, pad_id), pos, sub.response_mask)
              for mb in mbs for sub in [p.select(mb)] for ids, pos in [packed(sub.prompts, sub.response_ids, pad_id)]]

    def step(it: Iterator[tuple[torch.Tensor, ...]], stage: Any) -> tuple[torch.Tensor, Any]:
        mb, ids, pos, mask = next(it)
        ids = ids.to(device)
        b, length = ids.shape
        positions = torch.arange(length, device=device).unsqueeze(0).expand(b, length)
        out = stage(ids, positions, None)  # last stage: logits [b, W, V/tp]; others: activations for the next

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
            logp = logits_logp(logits, ids, temperature).gather(1, pos.to(device)) * mask.to(device)  # [b, R]
            loss = loss_of(mb, logp) if loss_of is not None else logp.sum() * 0.0
            return loss, torch.ones((), dtype=torch.int), {"logp": logp.detach()}

        return out, loss_func

    run = get_forward_backward_func()
    data = run(forward_step_func=step, data_iterator=iter(inputs), model=[model], num_microbatches=len(inputs),
               seq_length=max(x[1].shape[1] for x in inputs), micro_batch_size=max(len(mb) for mb in mbs),
               forward_only=loss_of is None)
    return [d["logp"] for d in data] if is_last_stage() else []


def pipeline_logp(model: torch.nn.Module, p: Padded, pad_id: int, temperature: float,
                  micro_batch_size: int) -> torch.Tensor:
    """[B, R] response log-probs of the whole batch (no grad), the same on every stage."""
    b, r = p.response_ids.shape
    mbs = list(torch.arange(b).split(micro_batch_size))
    with torch.no_grad():
        parts = run_pipeline(model, p, mbs, pad_id, temperature)
    device = next(model.parameters()).device
    mine = torch.cat(parts) if parts else None
    return from_last_stage(mine, (b, r), torch.float32, device)


def pipeline_forward_backward(model: torch.nn.Module, pad_id: int) -> ForwardBackward:
    """grpo_step's `forward_backward` for a pipeline stage."""
    def run(p: Padded, mbs: list[torch.Tensor], temperature: float, loss_of: MicroLoss) -> None:
        run_pipeline(model, p, mbs, pad_id, temperature, loss_of)
    return run
