"""Flow-GRPO: RL on a flow-matching model through an SDE whose every denoising step is a Gaussian policy.

Paper: Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL", https://arxiv.org/abs/2505.05470
(§4.2: ODE-to-SDE conversion; §4.1: the GRPO objective over denoising steps).

Time runs with the scheduler's sigma from 1 (pure noise) to 0 (the image); the model predicts a velocity v(x_t, t).
The deterministic sampler steps x_{t+dt} = x_t + v dt (dt < 0). For a noise level a, the SDE with the same
marginals steps
    x_{t+dt} = x_t + [v + s_t^2 / (2t) * (x_t + (1 - t) v)] dt + s_t sqrt(-dt) eps,   s_t = a sqrt(t / (1 - t))
so one step is a Gaussian policy pi(x_{t+dt} | x_t) = N(mu, std^2) with
    mu  = x_t (1 + s_t^2 dt / (2t)) + v (1 + s_t^2 (1 - t) / (2t)) dt
    std = s_t sqrt(-dt)
At t = 1, t / (1 - t) is infinite; like both references, s_t there uses the next sigma in its denominator
(`sigma_max` = sigmas[1]).
    log pi per element = -(x' - mu)^2 / (2 std^2) - log std - log sqrt(2 pi)
and a step's log-prob is its MEAN over the latent elements C*H*W (not the sum a joint density would give: both
references average, which keeps the ratio's scale independent of the resolution).

Sources this matches (same formulas, same fp32 casts, same per-element mean):
- yifan123/flow_grpo @ ac4c86e8cae021841f1fde853d340e0db67690dd flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:44
  (sigma_max), :47 (s_t), :50 (mu), :61-68 (log-prob, mean); scripts/train_sd3.py:881-897 (advantage clip, ratio,
  clipped loss, KL); flow_grpo/stat_tracking.py:29 (per-prompt advantages, std + 1e-4).
- sgl-project/sglang python/sglang/multimodal_gen/runtime/post_training/scheduler_rl_mixin.py
  @ 1e7c58633c70b2cabb48bf64d9fd888d5372d263, `flow_sde_sampling` (sde branch): the rollout engine's side, the
  same mu / std and the log-prob from the drawn noise, divided by the element count (`collect_rollout_log_probs`).

Shapes: B samples (prompts x G, a prompt's G samples adjacent), T denoising steps, latents [C, H, W].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kora_trainer.algorithm.grpo import LossOut, group_advantages, grpo_loss

# (latents [B, C, H, W], timestep [B] on the scheduler's 0..1000 scale) -> velocity [B, C, H, W]
VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def sde_std(sigma: torch.Tensor, sigma_max: float, noise_level: float) -> torch.Tensor:
    """sigma [B] -> s_t [B] = a sqrt(t / (1 - t)), t = 1 replaced by sigma_max in the denominator only."""
    denom = 1 - torch.where(sigma == 1, torch.full_like(sigma, sigma_max), sigma)
    return torch.sqrt(sigma / denom) * noise_level


def sde_step(velocity: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             sigma_max: float, noise_level: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One SDE step's Gaussian: velocity, latents [B, C, H, W]; sigma, sigma_next [B] ->
    (mu [B, C, H, W], std [B, 1, 1, 1]). Computed in fp32 whatever the model's dtype (bf16 overflows here)."""
    v, x = velocity.float(), latents.float()
    shape = (-1,) + (1,) * (x.ndim - 1)
    t, dt = sigma.float().view(shape), (sigma_next.float() - sigma.float()).view(shape)  # [B, 1, 1, 1], dt < 0
    s = sde_std(sigma.float(), sigma_max, noise_level).view(shape)  # [B, 1, 1, 1]
    mean = x * (1 + s**2 / (2 * t) * dt) + v * (1 + s**2 * (1 - t) / (2 * t)) * dt
    return mean, s * torch.sqrt(-dt)


def step_log_prob(next_latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(next_latents; mean, std^2) averaged over the latent elements: [B, C, H, W] x2, [B, 1, 1, 1] -> [B]."""
    lp = -((next_latents.detach().float() - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, lp.ndim)))


@dataclass
class Trajectory:
    """What a rollout records per sample: every latent, the step schedule, and each step's log-prob."""

    latents: torch.Tensor  # [B, T+1, C, H, W] fp32: x at sigmas[0] (the initial noise) ... sigmas[T] = 0 (the image)
    log_probs: torch.Tensor  # [B, T] fp32: log pi(latents[:, j+1] | latents[:, j]) under the rollout policy
    timesteps: torch.Tensor  # [T] the model's timestep input at step j (sigma_j x num_train_timesteps)
    sigmas: torch.Tensor  # [T+1] the schedule, sigmas[T] = 0
    noise_level: float

    @property
    def images(self) -> torch.Tensor:
        return self.latents[:, -1]  # [B, C, H, W]

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.numel())

    def to(self, device: torch.device) -> Trajectory:
        """The same trajectory on `device` (the engine's answer arrives on the CPU; the trainer scores on its own)."""
        return Trajectory(latents=self.latents.to(device), log_probs=self.log_probs.to(device),
                          timesteps=self.timesteps.to(device), sigmas=self.sigmas.to(device),
                          noise_level=self.noise_level)


def schedule(scheduler: object, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A diffusers FlowMatchEulerDiscreteScheduler's schedule for `num_steps`: (timesteps [T], sigmas [T+1])."""
    scheduler.set_timesteps(num_steps)  # type: ignore[attr-defined]
    return scheduler.timesteps.float().clone(), scheduler.sigmas.float().clone()  # type: ignore[attr-defined]


def _randn(shape: Sequence[int], generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One draw per sample from its own generator (sglang-diffusion's per-item generator list): [B, *shape]."""
    return torch.stack([torch.randn(tuple(shape), generator=g) for g in generators])


@torch.no_grad()
def sample(velocity: VelocityFn, latent_shape: Sequence[int], timesteps: torch.Tensor, sigmas: torch.Tensor,
           noise_level: float, generators: Sequence[torch.Generator], device: torch.device | None = None
           ) -> Trajectory:
    """Roll out B = len(generators) samples with the SDE, recording all T+1 latents and each step's log-prob.

    Sample i's initial noise and step noises come from generators[i] (so a sample is reproducible alone); the
    generators are CPU ones whatever `device` the model runs on (the draws are the same on any device), and the
    trajectory is on `device` (default: the CPU).
    """
    dev = device or torch.device("cpu")
    sigma_max = float(sigmas[1]) if sigmas.numel() > 1 else float(sigmas[0])
    timesteps, sigmas = timesteps.to(dev), sigmas.to(dev)
    x = _randn(latent_shape, generators).to(dev)  # [B, C, H, W] x at sigma 1
    batch = x.shape[0]
    latents, log_probs = [x], []
    for j in range(timesteps.numel()):
        v = velocity(x, timesteps[j].expand(batch))  # [B, C, H, W]
        mean, std = sde_step(v, x, sigmas[j].expand(batch), sigmas[j + 1].expand(batch), sigma_max, noise_level)
        x = mean + std * _randn(latent_shape, generators).to(dev)  # [B, C, H, W]
        log_probs.append(step_log_prob(x, mean, std))  # [B]
        latents.append(x)
    return Trajectory(latents=torch.stack(latents, dim=1), log_probs=torch.stack(log_probs, dim=1),
                      timesteps=timesteps, sigmas=sigmas, noise_level=noise_level)


def rescore(velocity: VelocityFn, traj: Trajectory, step: int,
            rows: slice | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trainer's side: the log-prob of the recorded step `step` under the current model (differentiable).

    Uses the trajectory's OWN timestep, sigmas and noise level: the Gaussian must be the one the rollout drew from,
    or the ratio pi / pi_old is off before any update. Returns (log_prob [b], mu [b, C, H, W], std [b, 1, 1, 1]) for
    the rows `rows` of the batch (all by default).
    """
    pick = slice(None) if rows is None else rows
    x, x_next = traj.latents[pick, step], traj.latents[pick, step + 1]  # [b, C, H, W]
    b = x.shape[0]
    sigma_max = float(traj.sigmas[1]) if traj.sigmas.numel() > 1 else float(traj.sigmas[0])
    v = velocity(x, traj.timesteps[step].expand(b))
    mean, std = sde_step(v, x, traj.sigmas[step].expand(b), traj.sigmas[step + 1].expand(b), sigma_max,
                         traj.noise_level)
    return step_log_prob(x_next, mean, std), mean, std


def advantages(rewards: torch.Tensor, group_size: int, clip: float = 5.0) -> torch.Tensor:
    """rewards [B] (a prompt's G samples adjacent) -> per-prompt normalised advantages [B], clipped to +-clip
    (flow_grpo: std + 1e-4, adv_clip_max 5)."""
    return group_advantages(rewards, group_size, eps=1e-4).clamp(-clip, clip)


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, std^2) || N(ref_mean, std^2)) per element, averaged: [B, C, H, W] x2, [B, 1, 1, 1] -> [B].

    Both steps share std (it depends only on the schedule), so the KL is exactly (mu - mu_ref)^2 / (2 std^2).
    flow_grpo (train_sd3.py:895) divides by 2 s_t^2 without the sqrt(-dt) factor, i.e. its value is this one times
    -dt: a flow_grpo beta corresponds to beta * |dt| here.
    """
    kl = (mean - ref_mean) ** 2 / (2 * std**2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))


def flow_grpo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, adv: torch.Tensor, clip_eps: float = 1e-4,
                   kl: torch.Tensor | None = None, kl_coef: float = 0.0, num_terms: float | None = None) -> LossOut:
    """The clipped surrogate over (sample, step) pairs, + kl_coef x the mean step KL to the adapter-off base.

    log_probs, old_log_probs [B, T'] (T' steps trained), adv [B] (one per sample, shared by its steps), kl [B, T'].
    A denoising step plays the part a token plays in LLM GRPO, so the token-level loss of algorithm/grpo.py is
    reused as is with an all-ones mask; `num_terms` = B x T' of the whole optimizer batch when the batch is split.
    """
    mask = torch.ones_like(log_probs)
    out = grpo_loss(log_probs, old_log_probs, adv, mask, clip_eps=clip_eps, num_tokens=num_terms)
    if kl is not None:
        kl_mean = kl.sum() / (num_terms if num_terms is not None else kl.numel())
        if kl_coef > 0:
            out.loss = out.loss + kl_coef * kl_mean
        out.kl = float(kl_mean.detach())
    return out
