"""Flow-GRPO on the diffusion toy in one process (CPU): rollout -> reward -> advantages -> re-score -> update.

The first increment of issue 23's actor: no Ray, no engine, no sync yet: the rollout runs in the trainer's own
process with the policy being trained (so the rollout policy is the current one and the ratio starts at 1).
What it shows is that the math learns: `evaluate` before and after (fixed seeds, every prompt) measures the rise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kora_trainer.algorithm import flow_grpo
from kora_trainer.algorithm.diffusion_rewards import colour_reward
from kora_trainer.lora.diffusers import SD3_TARGETS, apply_diffusion_lora
from kora_trainer.lora.model import adapter_disabled, adapter_parameters
from kora_trainer.toys.diffusion import DiffusionToy, load_diffusion_toy
from kora_trainer.toys.diffusion_policy import generators, velocity_fn


@dataclass(frozen=True)
class FlowGRPOSettings:
    """The knobs of one run (the SD3 OCR recipe's names in brackets: 8 prompts x 16 samples, 10 steps, noise 0.7,
    r 32 / alpha 64, clip 1e-4; the toy uses smaller groups and rank to fit 2 CPU cores)."""

    prompts_per_step: int = 8
    samples_per_prompt: int = 8  # G, the group size
    num_inference_steps: int = 6  # T (the recipe: 10)
    noise_level: float = 0.7  # a in s_t = a sqrt(t / (1 - t))
    guidance_scale: float = 1.0  # classifier-free guidance (1: none); rollouts and re-scores use the guided velocity
    timestep_fraction: float = 1.0  # train on the first max(1, int(T x this)) denoising steps of each image
    lr: float = 5e-3
    clip_eps: float = 1e-4
    kl_coef: float = 0.0  # beta: KL to the adapter-off base per step
    measure_kl: bool = False  # compute that KL with kl_coef 0 too (tracking.klToBase); else only when kl_coef > 0
    adv_clip: float = 5.0
    max_grad_norm: float = 1.0
    minibatches: int = 1  # optimizer steps per rollout batch (the samples split evenly)
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_init: str = "gaussian"
    seed: int = 0


@dataclass
class StepStats:
    step: int
    reward_mean: float
    reward_std: float
    clip_frac: float
    kl: float
    ratio_mean: float
    elapsed_s: float


@torch.no_grad()
def evaluate(toy: DiffusionToy, settings: FlowGRPOSettings, samples_per_prompt: int = 4, seed: int = 12_345) -> float:
    """Mean reward over every prompt, `samples_per_prompt` each, with fixed noise (the same draws before and after
    training): the number a reward-rise claim is made on."""
    ids = torch.arange(len(toy.prompts)).repeat_interleave(samples_per_prompt)
    timesteps, sigmas = flow_grpo.schedule(toy.scheduler, settings.num_inference_steps)
    traj = flow_grpo.sample(velocity_fn(toy, ids, guidance=settings.guidance_scale), toy.latent_shape, timesteps,
                            sigmas, settings.noise_level, generators(seed, 0, ids.numel()), toy.device)
    return float(colour_reward(traj.images.cpu(), toy.targets[ids]).mean())


def trained_steps(num_steps: int, fraction: float) -> int:
    """How many of a trajectory's first denoising steps the update trains on (flow_grpo: int(T x fraction))."""
    return max(1, int(num_steps * fraction))


def update(toy: DiffusionToy, settings: FlowGRPOSettings, traj: flow_grpo.Trajectory, ids: torch.Tensor,
           adv: torch.Tensor, opt: torch.optim.Optimizer) -> dict[str, float]:
    """One pass over the batch in `minibatches` optimizer steps; each step's loss is accumulated over the trained
    denoising steps, all T or the first trained_steps(T, timestep_fraction) (one backward per step: memory holds
    one step's graph), as flow_grpo accumulates them.

    Besides the loss terms it measures the serving check: |trainer re-score - rollout log-prob| over every
    (sample, trained step) of the first minibatch, before this batch's first optimizer step — 0 up to rounding when the
    rollouts came from exactly the policy the trainer holds (`logp_gap_max`, `logp_gap_mean`)."""
    params = adapter_parameters(toy.transformer)
    traj, adv = traj.to(toy.device), adv.to(toy.device)  # rollouts arrive on the CPU; the policy may be on a GPU
    batch, steps = adv.numel(), trained_steps(traj.num_steps, settings.timestep_fraction)
    stats = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "ratio_mean": 0.0, "grad_norm": 0.0, "logp_gap_max": 0.0}
    gap_sum, gap_n = 0.0, 0
    for k, rows in enumerate(torch.arange(batch).chunk(settings.minibatches)):
        opt.zero_grad(set_to_none=True)
        velocity = velocity_fn(toy, ids, rows, settings.guidance_scale)
        for j in range(steps):
            log_prob, mean, std = flow_grpo.rescore(velocity, traj, j, rows)  # [b], [b, C, H, W], [b, 1, 1, 1]
            if k == 0:
                gap = (log_prob.detach() - traj.log_probs[rows, j]).abs()
                stats["logp_gap_max"] = max(stats["logp_gap_max"], float(gap.max()))
                gap_sum, gap_n = gap_sum + float(gap.sum()), gap_n + gap.numel()
            kl = None
            if settings.kl_coef > 0 or settings.measure_kl:
                with torch.no_grad(), adapter_disabled(toy.transformer):
                    _, ref_mean, _ = flow_grpo.rescore(velocity, traj, j, rows)
                kl = flow_grpo.gaussian_kl(mean, ref_mean, std).unsqueeze(1)  # [b, 1]
            out = flow_grpo.flow_grpo_loss(log_prob.unsqueeze(1), traj.log_probs[rows, j:j + 1], adv[rows],
                                           clip_eps=settings.clip_eps, kl=kl, kl_coef=settings.kl_coef,
                                           num_terms=float(rows.numel() * steps))
            out.loss.backward()
            n = settings.minibatches * steps
            stats["loss"] += float(out.loss.detach()) / settings.minibatches  # the minibatch's loss sums its steps
            stats["clip_frac"] += out.clip_frac / n
            stats["kl"] += out.kl / n
            stats["ratio_mean"] += out.ratio_mean / n
        norm = torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
        stats["grad_norm"] += float(norm) / settings.minibatches
        opt.step()
    stats["logp_gap_mean"] = gap_sum / max(gap_n, 1)
    return stats


# (the toy, prompt ids [B] with a prompt's G samples adjacent, the step) -> the rollout of those samples
RolloutFn = Callable[[DiffusionToy, torch.Tensor, int], flow_grpo.Trajectory]


def local_rollout(settings: FlowGRPOSettings) -> RolloutFn:
    """Roll out in the trainer's own process with the policy being trained."""
    def roll(toy: DiffusionToy, ids: torch.Tensor, step: int) -> flow_grpo.Trajectory:
        timesteps, sigmas = flow_grpo.schedule(toy.scheduler, settings.num_inference_steps)
        return flow_grpo.sample(velocity_fn(toy, ids, guidance=settings.guidance_scale), toy.latent_shape, timesteps,
                                sigmas, settings.noise_level, generators(settings.seed, step, ids.numel()),
                                toy.device).to(torch.device("cpu"))
    return roll


def train_toy(toy_dir: str | Path, settings: FlowGRPOSettings, steps: int, time_limit_s: float | None = None,
              on_step: Callable[[StepStats], None] | None = None, eval_every: int = 0,
              rollout: RolloutFn | None = None, sync: Callable[[Any], object] | None = None) -> dict[str, Any]:
    """Train a LoRA on the toy for `steps` steps (or until `time_limit_s`); return the summary with the reward
    before and after (`evaluate`), every `eval_every` steps' evaluation (the curve; 0: none) and each step's
    stats. Deterministic for a given step count (1 CPU thread): time only decides how far a time limit gets.
    `rollout`: where samples come from (default: this process); `sync(transformer)`: called after every optimizer
    pass, to push the new policy to the engine that `rollout` asks (wire/diffusion_client.py)."""
    roll = rollout if rollout is not None else local_rollout(settings)
    toy = load_diffusion_toy(toy_dir)
    toy.transformer.eval()  # no dropout in SD3's blocks; eval keeps any future one out of the log-prob match
    torch.manual_seed(settings.seed)  # the adapter's A init draws from the global stream
    apply_diffusion_lora(toy.transformer, settings.lora_rank, settings.lora_alpha, SD3_TARGETS, settings.lora_init)
    opt = torch.optim.AdamW(adapter_parameters(toy.transformer), lr=settings.lr, weight_decay=0.0)
    before = evaluate(toy, settings)
    rng = torch.Generator().manual_seed(settings.seed)
    history: list[StepStats] = []
    curve: list[tuple[int, float, float]] = [(0, before, 0.0)]  # (steps done, evaluate(), seconds of training)
    t0 = time.monotonic()
    for step in range(steps):
        prompt_ids = torch.randperm(len(toy.prompts), generator=rng)[:settings.prompts_per_step]
        ids = prompt_ids.repeat_interleave(settings.samples_per_prompt)  # [B] a prompt's G samples adjacent
        traj = roll(toy, ids, step)
        rewards = colour_reward(traj.images, toy.targets[ids])  # [B]
        adv = flow_grpo.advantages(rewards, settings.samples_per_prompt, settings.adv_clip)
        stats = update(toy, settings, traj, ids, adv, opt)
        if sync is not None:
            sync(toy.transformer)
        history.append(StepStats(step=step, reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                                 elapsed_s=round(time.monotonic() - t0, 3), clip_frac=stats["clip_frac"],
                                 kl=stats["kl"], ratio_mean=stats["ratio_mean"]))
        if on_step is not None:
            on_step(history[-1])
        if eval_every and (step + 1) % eval_every == 0:
            curve.append((step + 1, evaluate(toy, settings), round(time.monotonic() - t0, 1)))
        if time_limit_s is not None and time.monotonic() - t0 > time_limit_s:
            break
    return {"reward_before": before, "reward_after": evaluate(toy, settings), "steps": len(history),
            "train_s": round(time.monotonic() - t0, 1), "settings": asdict(settings), "curve": curve,
            "history": [asdict(h) for h in history]}
