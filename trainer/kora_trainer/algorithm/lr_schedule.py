"""The adapter's learning rate at each step: a linear warmup, then a constant, linear or cosine decay to a floor.

The shape is Megatron-LM's (`--lr-warmup-iters`, `--lr-decay-style`, `--lr-decay-iters`, `--min-lr`, which slime
and miles pass through), counted in rollout steps, the steps a job's numSteps and status count. It is a pure
function of the step rather than torch's LambdaLR: a resumed run sets the same rate from the step it restarts at,
so the checkpoint carries no scheduler state and exact resume stays exact.
"""

from __future__ import annotations

import math

import torch

from kora_trainer.config.sections import AlgorithmSpec, LrDecayStyle


def decay_steps(alg: AlgorithmSpec) -> int:
    """The steps over which the rate falls to minLr: lrDecaySteps, else numSteps (the CRD's rules require one of
    them for a decaying schedule; a constant one never reads it)."""
    return int(alg.lr_decay_steps or alg.num_steps or 1)


def lr_at(alg: AlgorithmSpec, step: int) -> float:
    """The learning rate of 0-based step `step`: lr x (step+1)/lrWarmupSteps during the warmup, then lr at the
    first step after it, decayed along lrDecayStyle to reach minLr at step index lrDecaySteps, minLr after it.
    As in Megatron, the last step of a run whose lrDecaySteps is numSteps trains just above minLr, never at it:
    a step at a rate of 0 would change nothing (and its push would be skipped as unchanged)."""
    warmup = alg.lr_warmup_steps
    if step < warmup:
        return alg.lr * (step + 1) / warmup
    if alg.lr_decay_style is LrDecayStyle.CONSTANT:
        return alg.lr
    span = max(decay_steps(alg) - warmup, 1)
    ratio = min(max(step - warmup, 0) / span, 1.0)
    linear = alg.lr_decay_style is LrDecayStyle.LINEAR
    coeff = 1.0 - ratio if linear else 0.5 * (1.0 + math.cos(math.pi * ratio))
    return alg.min_lr + (alg.lr - alg.min_lr) * coeff


def apply_lr(optimizer: torch.optim.Optimizer, alg: AlgorithmSpec, step: int) -> float:
    """Set every parameter group of `optimizer` to 0-based step `step`'s rate; return it."""
    lr = lr_at(alg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
