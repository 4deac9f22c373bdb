"""One GRPO step on a backend's adapter: the loop both backends run (torch and megatron differ only in how
they compute log-probs, turn the adapter off and clip the gradient norm, which they pass in).

Old log-probs: at temperature 1 the ratio's denominator is the engine's own log-probs of the tokens it
sampled (no extra forward; after a correct sync they equal ours, which `rollout_logp_gap` tracks every
step). Engines report raw log-probs (before temperature, SGLang's default), so at T != 1 they are not the
sampling distribution: there the actor recomputes them at T before the first update.

Minibatches hold whole GRPO groups (shuffled by the backend's private generator, which checkpoints save),
micro-batches accumulate gradients, and the loss is normalised by the minibatch's response tokens. With data
parallelism each rank takes its share of every minibatch and the gradients are summed over the ranks
(`data_parallel.py`), so the step is the one-rank step's; the metrics are summed over the ranks likewise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from kora_trainer.algorithm.grpo import group_advantages, grpo_loss
from kora_trainer.algorithm.lr_schedule import apply_lr
from kora_trainer.backends.batch import Padded, RolloutBatch, pad
from kora_trainer.backends.data_parallel import DataParallel
from kora_trainer.config import TrainerConfig


@dataclass(frozen=True)
class StepMetrics:
    """One GRPO step, as the trainer's worker returns it through Ray to the driver's recorder. The loss terms
    are means over the step's optimizer updates."""

    version: int  # the policy version after this step's update
    reward_mean: float
    samples: int
    updates: int  # optimizer steps taken (inner epochs x optimizer batches)
    loss: float  # clipped policy-gradient loss
    clip_frac: float  # share of tokens whose ratio was clipped
    kl: float  # k3 estimate against the base (the adapter switched off)
    ratio: float  # mean policy ratio against the engines' log-probs
    grad_norm: float
    response_len: float  # mean tokens per response
    rollout_logp_gap_max: float | None  # max |trainer - engine| log-prob of the sampled tokens (None: async)
    rollout_logp_gap_mean: float | None
    rollout_version_lag: int  # policy versions the rollouts lagged the trainer
    train_ms: float
    dp_allreduce_ms: float = 0.0  # of train_ms: summing the adapter gradients over the data-parallel ranks
    logprob_ms: float = 0.0  # of train_ms: the no-grad log-prob forwards (temperature != 1, the KL reference)
    tokens: int = 0  # prompt + response tokens of the batch (one pass; innerEpochs passes train on them)
    # for the trackers (docs/metrics.md): the batch's reward spread and lengths, and the update's statistics
    reward_std: float = 0.0
    reward_min: float = 0.0
    reward_max: float = 0.0
    response_len_max: int = 0
    response_len_min: int = 0
    kl_measured: bool = False  # `kl` was computed (algorithm.klCoef > 0 or tracking.klToBase); else it reads 0
    ppo_kl: float = 0.0  # mean log(π_old/π_θ) over the tokens: how far the updates moved off the rollout policy
    # Monte-Carlo estimate of the per-token entropy of the sampling policy: -mean log π(sampled token), unbiased
    # because the tokens were drawn from that very distribution (no full-vocabulary logits kept)
    entropy: float = 0.0
    lr: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

TokenLogp = Callable[[Padded, float], torch.Tensor]  # (padded batch, temperature) -> [B, R]
MicroLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (micro-batch's sample indices, its [b, R] logp)
# (padded batch, micro-batches' sample indices, temperature, loss of a micro-batch): forwards and backwards them all
ForwardBackward = Callable[[Padded, list[torch.Tensor], float, MicroLoss], None]


def one_by_one(token_logp: TokenLogp) -> ForwardBackward:
    """Each micro-batch forward then backward, in turn (one stage: the torch backend, megatron without pipeline)."""
    def run(p: Padded, mbs: list[torch.Tensor], temperature: float, loss_of: MicroLoss) -> None:
        for mb in mbs:
            loss_of(mb, token_logp(p.select(mb), temperature)).backward()
    return run


class StepOwner(Protocol):
    cfg: TrainerConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    device: torch.device
    pad_id: int
    version: int
    micro_batch_size: int
    max_grad_norm: float
    dp: DataParallel
    stages: DataParallel  # the pipeline group (size 1 without one): metrics summed over it too
    _shuffle: torch.Generator


class ShuffleState:
    """The backends' checkpoint hooks for their private minibatch-shuffle generator (the global and CUDA RNGs
    are captured by the checkpoint itself)."""

    _shuffle: torch.Generator

    def generator_states(self) -> dict[str, torch.Tensor]:
        return {"shuffle": self._shuffle.get_state()}

    def load_generator_states(self, states: dict[str, torch.Tensor]) -> None:
        if "shuffle" in states:
            self._shuffle.set_state(states["shuffle"])


def grpo_step(owner: StepOwner, batch: RolloutBatch, token_logp: TokenLogp,
              adapter_off: Callable[[], AbstractContextManager[None]],
              clip_grad_norm: Callable[[list[torch.nn.Parameter], float], float],
              forward_backward: ForwardBackward | None = None) -> StepMetrics:
    """Train `owner`'s adapter on one batch of rollouts; bumps `owner.version`; returns the step's metrics.
    `forward_backward` runs a minibatch's micro-batches (default: one by one through `token_logp`); with pipeline
    stages only the last one computes losses, so the metrics are summed over the stages too."""
    forward_backward = forward_backward or one_by_one(token_logp)
    t0 = time.monotonic()
    alg = owner.cfg.algorithm
    device = owner.device
    p = pad(batch.prompt_ids, batch.response_ids, batch.rollout_logprobs, owner.pad_id, batch.images)
    mask = p.response_mask.to(device)  # [B, R]
    adv = group_advantages(torch.tensor(batch.rewards), batch.group_size).to(device)  # [B]
    temperature = alg.temperature if alg.temperature > 0 else 1.0
    with torch.no_grad():
        old = p.rollout_logp.to(device) if temperature == 1.0 else token_logp(p, temperature)  # [B, R]
        ref = None
        if alg.kl_coef > 0 or owner.cfg.tracking.kl_to_base:
            with adapter_off():
                ref = token_logp(p, temperature)  # [B, R] the base policy: the KL reference
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the forwards above ran asynchronously: time them whole
    logprob_s = time.monotonic() - t0
    # the engines tag what they served; with async rollouts that is an older version than ours
    served = [int(v) for v in batch.weight_versions if v is not None and v.isdigit()]
    lag = owner.version - min(served) if served else 0
    on_policy = all(v == str(owner.version) for v in batch.weight_versions)
    n = len(batch)
    gbs = min(alg.effective_global_batch_size, n)
    sums: dict[str, float] = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "ratio": 0.0, "ppo_kl": 0.0,
                              "grad_norm": 0.0}
    gap_max, gap_sum, gap_n = 0.0, 0.0, 0.0
    updates, reduce_s = 0, 0.0
    lr = apply_lr(owner.optimizer, alg, owner.version)  # a function of the step: resume-exact
    owner.model.train()  # LoRA dropout on
    for _ in range(alg.inner_epochs):
        # shuffle whole groups, so a minibatch holds complete groups (and their shared prompts)
        g = batch.group_size
        order = (torch.randperm(n // g, generator=owner._shuffle).unsqueeze(1) * g + torch.arange(g)).reshape(-1)
        for start in range(0, n, gbs):
            idx = order[start:start + gbs]
            num_tokens = float(p.response_mask[idx].sum())
            owner.optimizer.zero_grad(set_to_none=True)

            def loss_of(mb: torch.Tensor, logp: torch.Tensor, num_tokens: float = num_tokens,
                        first_update: bool = updates == 0) -> torch.Tensor:
                """The loss of micro-batch `mb` (sample indices) from its [b, R] log-probs; adds its metrics."""
                nonlocal gap_max, gap_sum, gap_n
                mbd = mb.to(device)
                out = grpo_loss(logp, old[mbd], adv[mbd], mask[mbd], alg.clip_eps,
                                None if ref is None else ref[mbd], alg.kl_coef, num_tokens=num_tokens)
                w = float(mask[mbd].sum()) / max(num_tokens, 1.0)
                # pg_loss and kl are already over the minibatch's tokens (num_tokens): a share adds up as is;
                # clip_frac and ratio are means over this micro-batch's tokens: weighted by its share
                sums["loss"] += out.pg_loss
                sums["clip_frac"] += out.clip_frac * w
                sums["kl"] += out.kl
                sums["ratio"] += out.ratio_mean * w
                sums["ppo_kl"] += out.ppo_kl * w
                if first_update and on_policy:  # before any update: trainer vs engine, the same policy
                    gap = (logp.detach() - old[mbd]).abs() * mask[mbd]
                    gap_max = max(gap_max, float(gap.max()))
                    gap_sum += float(gap.sum())
                    gap_n += float(mask[mbd].sum())
                return out.loss

            forward_backward(p, list(owner.dp.share(idx).split(owner.micro_batch_size)), temperature, loss_of)
            t_reduce = time.monotonic()
            owner.dp.allreduce_grads(owner.params)  # the minibatch's gradient: every rank's share summed
            reduce_s += time.monotonic() - t_reduce
            sums["grad_norm"] += clip_grad_norm(owner.params, owner.max_grad_norm)
            owner.optimizer.step()
            updates += 1
    owner.model.eval()
    owner.version += 1
    if device.type == "cuda":
        # the optimizer's kernels are still queued: the step's time includes them, and the push that follows
        # (which waits for them before it reads the adapter) does not
        torch.cuda.synchronize(device)
    # the shares' sums -> the step's (grad_norm is already the whole minibatch's on every rank)
    keys = ["loss", "clip_frac", "kl", "ratio", "ppo_kl"]
    *totals, gap_sum, gap_n = owner.stages.sum(owner.dp.sum([sums[k] for k in keys] + [gap_sum, gap_n]))
    sums.update(zip(keys, totals, strict=True))
    gap_max = owner.stages.max(owner.dp.max(gap_max))
    rewards = torch.tensor(batch.rewards)
    lengths = p.response_mask.sum(dim=1)  # [B]
    return StepMetrics(
        version=owner.version, reward_mean=float(rewards.mean()), samples=n, updates=updates,
        **{k: v / updates for k, v in sums.items()},
        response_len=float(p.response_mask.sum() / n),
        # None when the rollouts came from an older policy version (async): then no gap is expected
        rollout_logp_gap_max=gap_max if on_policy else None,
        rollout_logp_gap_mean=gap_sum / max(gap_n, 1.0) if on_policy else None,
        rollout_version_lag=lag,
        train_ms=round((time.monotonic() - t0) * 1000, 1),
        dp_allreduce_ms=round(reduce_s * 1000, 2),
        logprob_ms=round(logprob_s * 1000, 1),
        tokens=sum(len(x) for x in batch.prompt_ids) + sum(len(x) for x in batch.response_ids),
        reward_std=float(rewards.std()) if n > 1 else 0.0, reward_min=float(rewards.min()),
        reward_max=float(rewards.max()), response_len_max=int(lengths.max()), response_len_min=int(lengths.min()),
        kl_measured=ref is not None, entropy=float(-(old * mask).sum() / mask.sum().clamp(min=1.0)),
        lr=lr,
    )
