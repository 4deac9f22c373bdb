"""GRPO: group-relative advantages and the clipped, token-level policy loss.

Group Relative Policy Optimization, DeepSeekMath (Shao et al. 2024, https://arxiv.org/abs/2402.03300),
§4.1: sample G responses per prompt, score them, and use each response's reward normalised within
its group as the advantage of every one of its tokens (outcome supervision, §4.1.2) — no value model.
The policy loss is PPO's clipped surrogate per token (Schulman et al. 2017), averaged over all
response tokens of the batch (token-level, as DAPO §3.3 argues, https://arxiv.org/abs/2503.14476,
so long responses are not down-weighted). The optional KL term to the reference (with LoRA: the base
model, i.e. the adapter switched off) uses the k3 estimator of §4.1 eq. (4):
    KL ≈ π_ref/π_θ − log(π_ref/π_θ) − 1   (unbiased, always ≥ 0).

Shapes: B = samples in the (micro-)batch (prompts × G), T = response tokens (padded), mask [B, T] is 1 on
real response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                     scale_by_std: bool = True) -> torch.Tensor:
    """rewards [N*G] (the G samples of a prompt adjacent) -> advantages [N*G]: (r − mean_g) / (std_g + eps).

    A group whose samples all scored the same gets advantage 0: it carries no signal.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # [N, G]
    adv = r - r.mean(dim=1, keepdim=True)  # [N, G]
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=group_size > 1) + eps)
    return adv.view(-1)  # [N*G]


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar, differentiable
    pg_loss: float
    kl: float
    clip_frac: float
    ratio_mean: float
    ppo_kl: float = 0.0  # mean over tokens of log(π_old/π_θ): how far the update moved from the rollout policy


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float = 0.2, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
              num_tokens: float | None = None, num_samples: float | None = None) -> LossOut:
    """Token-level clipped surrogate (+ kl_coef · k3 KL to the reference).

    logp, old_logp, ref_logp: [B, T] log-probs of the sampled tokens under the current policy, the
    rollout policy (the engine's own log-probs) and the reference; advantages [B]; mask [B, T].
    `num_tokens`: the denominator of the token mean. Pass the response-token count of the WHOLE
    optimizer batch when micro-batching, so the accumulated gradient equals the full-batch one.
    `num_samples` (instead): each sample's tokens are averaged first and the sum over samples is divided by
    this constant — every sample enters with weight 1 / num_samples whatever else is in its optimizer batch,
    which multi-LoRA needs (an adapter's batch is known by its sample count before its tokens are).
    """
    mask = mask.to(logp.dtype)
    if num_samples is not None:  # a per-sample weight folded into the mask of the reductions below
        weights = 1.0 / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [B, 1]
        return _reduce(logp, old_logp, advantages, mask, mask * weights, float(num_samples), clip_eps, ref_logp,
                       kl_coef)
    denom = float(num_tokens) if num_tokens is not None else mask.sum().clamp(min=1.0)
    return _reduce(logp, old_logp, advantages, mask, mask, denom, clip_eps, ref_logp, kl_coef)


def _reduce(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
            weighted: torch.Tensor, denom: float | torch.Tensor, clip_eps: float, ref_logp: torch.Tensor | None,
            kl_coef: float) -> LossOut:
    """`mask` picks the real tokens (ratios, statistics); `weighted` / `denom` make the loss's mean."""
    log_ratio = (logp - old_logp) * mask  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [B, 1] broadcast over tokens
    unclipped = ratio * adv  # [B, T]
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv  # [B, T]
    pg = -torch.minimum(unclipped, clipped)  # [B, T]
    loss = (pg * weighted).sum() / denom
    kl_value = 0.0
    if ref_logp is not None:  # given with kl_coef 0 too, to measure the KL to the base (tracking.klToBase)
        d = (ref_logp - logp) * mask  # [B, T] log(π_ref/π_θ)
        k3 = torch.exp(d) - d - 1.0  # [B, T] ≥ 0
        kl = (k3 * weighted).sum() / denom
        if kl_coef > 0:
            loss = loss + kl_coef * kl
        kl_value = float(kl.detach())
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        was_clipped = ((ratio - 1.0).abs() > clip_eps).to(mask.dtype) * mask
        return LossOut(loss, float((pg * weighted).sum() / denom), kl_value, float(was_clipped.sum() / n),
                       float((ratio * mask).sum() / n), float(-log_ratio.sum() / n))
