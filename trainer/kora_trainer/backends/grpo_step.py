"""One GRPO step on a backend's adapter: the loop both backends run (torch and megatron differ only in how
they compute log-probs, turn the adapter off and clip the gradient norm, which they pass in).

Old log-probs: at temperature 1 the ratio's denominator is the engine's own log-probs of the tokens it
sampled (no extra forward; after a correct sync they equal ours, which `rollout_logp_gap` tracks every
step). Engines report raw log-probs (before temperature, SGLang's default), so at T != 1 they are not the
sampling distribution: there the actor recomputes them at T before the first update.

Minibatches hold whole GRPO groups (shuffled by the backend's own generator, which checkpoints save),
micro-batches accumulate gradients, and the loss is normalised by the minibatch's response tokens. With data
parallelism each rank takes its share of every minibatch and the gradients are summed over the ranks
(`data_parallel.py`), so the step is the one-rank step's; the metrics are summed over the ranks likewise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar, Protocol

import torch

from kora_trainer.algorithm.grpo import LossOut, group_advantages, grpo_loss
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
    # max |trainer after this step's update - engine| on the sampled tokens of each rank's first micro-batch: the gap
    # the serving check would see from an engine that stayed one version behind. A serving threshold above it cannot
    # tell a stale engine from a fresh one (None: off-policy rollouts, or pipeline stages)
    stale_logp_gap_max: float | None = None

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
    shuffle: torch.Generator  # the minibatch shuffle's own generator (checkpoints save it: ShuffleState)


class ShuffleState:
    """The backends' checkpoint hooks for their minibatch-shuffle generator (the global and CUDA RNGs are
    captured by the checkpoint itself)."""

    shuffle: torch.Generator

    def generator_states(self) -> dict[str, torch.Tensor]:
        return {"shuffle": self.shuffle.get_state()}

    def load_generator_states(self, states: dict[str, torch.Tensor]) -> None:
        if "shuffle" in states:
            self.shuffle.set_state(states["shuffle"])


def group_order(n: int, group_size: int, generator: torch.Generator) -> torch.Tensor:
    """A shuffle of `n` samples that keeps each GRPO group whole and in order, so a minibatch cut from it holds
    complete groups (and their shared prompts): [n] sample indices."""
    groups = torch.randperm(n // group_size, generator=generator)  # [n / G]
    return (groups.unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1)


@dataclass
class MetricSums:
    """What a step's micro-batches add up. The loss terms are shares of their minibatch (pg_loss and kl are already
    over the minibatch's tokens, so a share adds up as is; clip_frac, ratio and ppo_kl are means over a
    micro-batch's tokens, so each is weighted by its share of them): divided by the updates, each is the mean over
    the step's optimizer updates. The gap is the trainer's against the engine's log-probs of the sampled tokens,
    measured before any update of an on-policy batch."""

    loss: float = 0.0
    clip_frac: float = 0.0
    kl: float = 0.0
    ratio: float = 0.0
    ppo_kl: float = 0.0
    grad_norm: float = 0.0  # already the whole minibatch's on every rank: never summed over the ranks
    gap_max: float = 0.0
    gap_sum: float = 0.0
    gap_n: float = 0.0  # response tokens the gap was measured on

    # summed over the ranks, in this order; StepMetrics' means over the updates
    SUMMED: ClassVar[tuple[str, ...]] = ("loss", "clip_frac", "kl", "ratio", "ppo_kl", "gap_sum", "gap_n")
    MEANS: ClassVar[tuple[str, ...]] = ("loss", "clip_frac", "kl", "ratio", "ppo_kl", "grad_norm")

    def add(self, out: LossOut, share: float) -> None:
        self.loss += out.pg_loss
        self.clip_frac += out.clip_frac * share
        self.kl += out.kl
        self.ratio += out.ratio_mean * share
        self.ppo_kl += out.ppo_kl * share

    def add_gap(self, gap: torch.Tensor, tokens: float) -> None:
        """gap: [b, R] |trainer - engine| log-probs, 0 on padding."""
        self.gap_max = max(self.gap_max, float(gap.max()))
        self.gap_sum += float(gap.sum())
        self.gap_n += tokens

    def over_ranks(self, owner: StepOwner) -> MetricSums:
        """The step's sums: every data-parallel rank's (and pipeline stage's) shares summed, the gap's max taken."""
        totals = owner.stages.sum(owner.dp.sum([getattr(self, k) for k in self.SUMMED]))
        return replace(self, **dict(zip(self.SUMMED, totals, strict=True)),
                       gap_max=owner.stages.max(owner.dp.max(self.gap_max)))

    def means(self, updates: int) -> dict[str, float]:
        return {k: getattr(self, k) / updates for k in self.MEANS}


@dataclass
class StepTimes:
    """Where a step's time goes (StepMetrics' train_ms, logprob_ms, dp_allreduce_ms), kept apart from the update.
    On CUDA each mark first waits for the kernels queued so far, so a phase's time includes them."""

    device: torch.device
    start: float = field(default_factory=time.monotonic)
    logprob_s: float = 0.0
    allreduce_s: float = 0.0

    def settled(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.monotonic()

    def allreduce_grads(self, owner: StepOwner) -> None:
        """The minibatch's gradient: every rank's share summed (data_parallel.py), timed."""
        t = time.monotonic()
        owner.dp.allreduce_grads(owner.params)
        self.allreduce_s += time.monotonic() - t


@dataclass(frozen=True)
class StepInputs:
    """A batch made ready for its updates: padded, its advantages, and the log-probs its losses compare against."""

    p: Padded
    mask: torch.Tensor  # [B, R] on the device
    adv: torch.Tensor  # [B]
    old: torch.Tensor  # [B, R] the rollout policy's log-probs (the ratio's denominator)
    ref: torch.Tensor | None  # [B, R] the base policy's (the KL reference), None when not measured
    temperature: float


def step_inputs(owner: StepOwner, batch: RolloutBatch, token_logp: TokenLogp,
                adapter_off: Callable[[], AbstractContextManager[None]]) -> StepInputs:
    """Pad the batch, its group advantages, and the no-grad forwards: the old log-probs (the engine's own at
    temperature 1, recomputed at T otherwise) and, when the KL is wanted, the base policy's (adapter off)."""
    alg, device = owner.cfg.algorithm, owner.device
    p = pad(batch.prompt_ids, batch.response_ids, batch.rollout_logprobs, owner.pad_id, batch.images)
    adv = group_advantages(torch.tensor(batch.rewards), batch.group_size).to(device)  # [B]
    temperature = alg.temperature if alg.temperature > 0 else 1.0
    with torch.no_grad():
        old = p.rollout_logp.to(device) if temperature == 1.0 else token_logp(p, temperature)  # [B, R]
        ref = None
        if alg.kl_coef > 0 or owner.cfg.tracking.kl_to_base:
            with adapter_off():
                ref = token_logp(p, temperature)  # [B, R] the base policy: the KL reference
    return StepInputs(p, p.response_mask.to(device), adv, old, ref, temperature)


def micro_loss(owner: StepOwner, x: StepInputs, sums: MetricSums, num_tokens: float, measure_gap: bool
               ) -> MicroLoss:
    """The loss of a micro-batch (its sample indices, its [b, R] log-probs) of a minibatch of `num_tokens` response
    tokens; each call adds its statistics to `sums` (and its log-prob gap when `measure_gap`)."""
    alg = owner.cfg.algorithm

    def loss_of(mb: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        mbd = mb.to(owner.device)
        out = grpo_loss(logp, x.old[mbd], x.adv[mbd], x.mask[mbd], alg.clip_eps,
                        None if x.ref is None else x.ref[mbd], alg.kl_coef, num_tokens=num_tokens)
        sums.add(out, share=float(x.mask[mbd].sum()) / max(num_tokens, 1.0))
        if measure_gap:  # before any update: trainer vs engine, the same policy
            sums.add_gap((logp.detach() - x.old[mbd]).abs() * x.mask[mbd], float(x.mask[mbd].sum()))
        return out.loss
    return loss_of


def update(owner: StepOwner, batch: RolloutBatch, x: StepInputs, forward_backward: ForwardBackward,
           clip_grad_norm: Callable[[list[torch.nn.Parameter], float], float], on_policy: bool,
           times: StepTimes) -> tuple[MetricSums, int]:
    """innerEpochs passes over the batch in minibatches of whole groups, one optimizer update each (this rank's
    share of it, micro-batch by micro-batch); bumps `owner.version`. Returns this rank's sums and the updates."""
    alg = owner.cfg.algorithm
    n = len(batch)
    gbs = min(alg.effective_global_batch_size, n)
    sums, updates = MetricSums(), 0
    owner.model.train()  # LoRA dropout on
    for _ in range(alg.inner_epochs):
        order = group_order(n, batch.group_size, owner.shuffle)  # [n]
        for start in range(0, n, gbs):
            idx = order[start:start + gbs]
            num_tokens = float(x.p.response_mask[idx].sum())
            owner.optimizer.zero_grad(set_to_none=True)
            loss_of = micro_loss(owner, x, sums, num_tokens, measure_gap=on_policy and updates == 0)
            forward_backward(x.p, list(owner.dp.share(idx).split(owner.micro_batch_size)), x.temperature, loss_of)
            times.allreduce_grads(owner)
            sums.grad_norm += clip_grad_norm(owner.params, owner.max_grad_norm)
            owner.optimizer.step()
            updates += 1
    owner.model.eval()
    owner.version += 1
    return sums, updates


def grpo_step(owner: StepOwner, batch: RolloutBatch, token_logp: TokenLogp,
              adapter_off: Callable[[], AbstractContextManager[None]],
              clip_grad_norm: Callable[[list[torch.nn.Parameter], float], float],
              forward_backward: ForwardBackward | None = None) -> StepMetrics:
    """Train `owner`'s adapter on one batch of rollouts; bumps `owner.version`; returns the step's metrics.
    `forward_backward` runs a minibatch's micro-batches (default: one by one through `token_logp`); with pipeline
    stages only the last one computes losses, so the metrics are summed over the stages too."""
    times = StepTimes(owner.device)
    x = step_inputs(owner, batch, token_logp, adapter_off)
    times.logprob_s = times.settled() - times.start  # the forwards above ran asynchronously: time them whole
    # the engines tag what they served; with async rollouts that is an older version than ours
    served = [int(v) for v in batch.weight_versions if v is not None and v.isdigit()]
    lag = owner.version - min(served) if served else 0
    on_policy = all(v == str(owner.version) for v in batch.weight_versions)
    lr = apply_lr(owner.optimizer, owner.cfg.algorithm, owner.version)  # a function of the step: resume-exact
    sums, updates = update(owner, batch, x, forward_backward or one_by_one(token_logp), clip_grad_norm, on_policy,
                           times)
    # the optimizer's kernels are still queued: the step's time includes them, and the push that follows (which
    # waits for them before it reads the adapter) does not
    stale = stale_gap(owner, x, token_logp) if on_policy else None
    times.settled()
    metrics = step_metrics(owner, batch, x, sums.over_ranks(owner), updates, on_policy, lag, lr, times)
    return replace(metrics, stale_logp_gap_max=stale)


def stale_gap(owner: StepOwner, x: StepInputs, token_logp: TokenLogp) -> float | None:
    """The updated policy's log-probs of one micro-batch (this rank's first) against the engine's: how far one
    step moved the sampled tokens, so what an engine that missed this push would show next step. One no-grad
    forward of one micro-batch. Not measured across pipeline stages (only the last one holds log-probs)."""
    if owner.stages.size > 1:
        return None
    mb = owner.dp.share(torch.arange(len(x.adv)))[:owner.micro_batch_size]
    mbd = mb.to(owner.device)
    with torch.no_grad():
        gap = (token_logp(x.p.select(mb), x.temperature) - x.old[mbd]).abs() * x.mask[mbd]
    return owner.dp.max(float(gap.max()) if len(mb) else 0.0)


def step_metrics(owner: StepOwner, batch: RolloutBatch, x: StepInputs, sums: MetricSums, updates: int,
                 on_policy: bool, lag: int, lr: float, times: StepTimes) -> StepMetrics:
    """The step's StepMetrics from its sums over the ranks, its batch and its times."""
    n = len(batch)
    rewards = torch.tensor(batch.rewards)
    lengths = x.p.response_mask.sum(dim=1)  # [B]
    return StepMetrics(
        version=owner.version, reward_mean=float(rewards.mean()), samples=n, updates=updates,
        **sums.means(updates),
        response_len=float(x.p.response_mask.sum() / n),
        # None when the rollouts came from an older policy version (async): then no gap is expected
        rollout_logp_gap_max=sums.gap_max if on_policy else None,
        rollout_logp_gap_mean=sums.gap_sum / max(sums.gap_n, 1.0) if on_policy else None,
        rollout_version_lag=lag,
        train_ms=round((time.monotonic() - times.start) * 1000, 1),
        dp_allreduce_ms=round(times.allreduce_s * 1000, 2),
        logprob_ms=round(times.logprob_s * 1000, 1),
        tokens=sum(len(ids) for ids in batch.prompt_ids) + sum(len(ids) for ids in batch.response_ids),
        reward_std=float(rewards.std()) if n > 1 else 0.0, reward_min=float(rewards.min()),
        reward_max=float(rewards.max()), response_len_max=int(lengths.max()), response_len_min=int(lengths.min()),
        kl_measured=x.ref is not None, entropy=float(-(x.old * x.mask).sum() / x.mask.sum().clamp(min=1.0)),
        lr=lr,
    )
