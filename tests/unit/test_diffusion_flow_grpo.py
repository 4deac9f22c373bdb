"""Flow-GRPO's math (kora_trainer/algorithm/flow_grpo.py) on the diffusion toy's real SD3 transformer, fp32.

The must-show: every step's log-prob the rollout recorded equals the trainer's re-score of that step before any
update — and the match is sharp: a re-score with another noise level or another step's timestep misses it.
"""

from __future__ import annotations

import pytest
import torch

from diffusionkit import toy_with_moved_adapter
from kora_trainer.algorithm import flow_grpo
from kora_trainer.lora.model import adapter_disabled
from kora_trainer.toys.diffusion_policy import generators, velocity_fn

STEPS, NOISE = 10, 0.7  # the SD3 recipe's 10 steps and noise level 0.7
TOL = 1e-5  # fp32 rounding of a re-score in other batch shapes (measured: exactly 0 on CPU)


@pytest.fixture(scope="module")
def rollout(diffusion_toy_dir):
    """4 prompts x 3 samples rolled out by the toy with a non-zero adapter."""
    toy = toy_with_moved_adapter(diffusion_toy_dir)
    ids = torch.tensor([0, 0, 0, 5, 5, 5, 9, 9, 9, 12, 12, 12])
    timesteps, sigmas = flow_grpo.schedule(toy.scheduler, STEPS)
    traj = flow_grpo.sample(velocity_fn(toy, ids), toy.latent_shape, timesteps, sigmas, NOISE,
                            generators(0, 0, ids.numel()))
    return toy, ids, traj


def test_a_rollout_records_every_latent_and_each_steps_log_prob(rollout):
    _, _, traj = rollout
    assert traj.latents.shape == (12, STEPS + 1, 4, 8, 8) and traj.log_probs.shape == (12, STEPS)
    assert traj.timesteps.shape == (STEPS,) and traj.sigmas.shape == (STEPS + 1,)
    assert traj.sigmas[0] == 1 and traj.sigmas[-1] == 0 and torch.allclose(traj.timesteps, traj.sigmas[:-1] * 1000)
    assert traj.latents.dtype == traj.log_probs.dtype == torch.float32
    assert torch.isfinite(traj.log_probs).all()


def test_the_rollout_log_prob_of_each_step_equals_the_trainers_rescore_at_step_0(rollout):
    toy, ids, traj = rollout
    worst = 0.0
    with torch.no_grad():
        for j in range(STEPS):
            # the trainer re-scores in its own minibatches: rows 0-6 and 7-11, not the rollout's batch of 12
            for rows in (torch.arange(0, 7), torch.arange(7, 12)):
                log_prob, _, _ = flow_grpo.rescore(velocity_fn(toy, ids, rows), traj, j, rows)
                worst = max(worst, float((log_prob - traj.log_probs[rows, j]).abs().max()))
    assert worst < TOL, worst  # fp32 rounding: other batch shapes, same maths


@pytest.mark.parametrize("wrong", ["noise level 0.75", "the next step's timestep", "the adapter off"])
def test_a_rescore_with_another_gaussian_misses_the_rollouts_log_prob(rollout, wrong):
    """What makes the match above a real check: each of these re-scores is off by over 10x its tolerance (measured
    at step 3: 2e-2 for noise 0.75, 8e-4 for the next timestep, 8e-4 for the adapter off; the match itself is 0; a
    step's log-prob moves little with the mean: it is an average over 256 elements)."""
    toy, ids, traj = rollout
    j = 3
    if wrong == "noise level 0.75":
        other = flow_grpo.Trajectory(traj.latents, traj.log_probs, traj.timesteps, traj.sigmas, 0.75)
    elif wrong == "the next step's timestep":
        shifted = torch.cat([traj.timesteps[1:], traj.timesteps[-1:]])
        other = flow_grpo.Trajectory(traj.latents, traj.log_probs, shifted, traj.sigmas, NOISE)
    else:
        other = traj
    with torch.no_grad():
        if wrong == "the adapter off":
            with adapter_disabled(toy.transformer):
                log_prob, _, _ = flow_grpo.rescore(velocity_fn(toy, ids), other, j)
        else:
            log_prob, _, _ = flow_grpo.rescore(velocity_fn(toy, ids), other, j)
    assert float((log_prob - traj.log_probs[:, j]).abs().max()) > 10 * TOL


def test_the_step_log_prob_is_the_gaussians_density_averaged_over_the_elements():
    gen = torch.Generator().manual_seed(1)
    x, mean = torch.randn(3, 4, 8, 8, generator=gen), torch.randn(3, 4, 8, 8, generator=gen)
    std = torch.tensor([0.3, 0.7, 1.1]).view(3, 1, 1, 1)
    expected = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x).mean(dim=(1, 2, 3))
    assert torch.allclose(flow_grpo.step_log_prob(x, mean, std), expected, atol=1e-6)


def test_the_sde_step_tends_to_the_euler_ode_step_and_its_noise_has_the_stated_std():
    gen = torch.Generator().manual_seed(2)
    x, v = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 4, 8, 8, generator=gen)
    sigma, sigma_next = torch.tensor([0.8, 0.3]), torch.tensor([0.6, 0.1])
    mean, std = flow_grpo.sde_step(v, x, sigma, sigma_next, sigma_max=0.96, noise_level=1e-4)
    euler = x + (sigma_next - sigma).view(2, 1, 1, 1) * v  # the deterministic sampler
    assert torch.allclose(mean, euler, atol=1e-6) and float(std.max()) < 1e-4
    _, std = flow_grpo.sde_step(v, x, sigma, sigma_next, sigma_max=0.96, noise_level=0.7)
    # s_t sqrt(-dt) with s_t = 0.7 sqrt(t / (1 - t))
    expected = 0.7 * torch.sqrt(sigma / (1 - sigma)) * torch.sqrt(sigma - sigma_next)
    assert torch.allclose(std.view(2), expected, atol=1e-6)
    # at sigma = 1 the denominator takes sigma_max: finite, not inf
    _, std1 = flow_grpo.sde_step(v, x, torch.tensor([1.0, 1.0]), torch.tensor([0.96, 0.96]), 0.96, 0.7)
    assert torch.allclose(std1.view(2), torch.full((2,), 0.7 * (1 / 0.04) ** 0.5 * 0.2), atol=1e-5)


def test_the_rollouts_draws_are_standard_normal_around_the_mean(rollout):
    toy, ids, traj = rollout
    j = 4
    with torch.no_grad():
        _, mean, std = flow_grpo.rescore(velocity_fn(toy, ids), traj, j)
    eps = (traj.latents[:, j + 1] - mean) / std  # [B, C, H, W]: 3072 draws
    assert abs(float(eps.mean())) < 0.1 and abs(float(eps.std()) - 1) < 0.05


def test_advantages_are_per_prompt_normalised_and_clipped():
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv = flow_grpo.advantages(rewards, group_size=3)
    assert torch.allclose(adv[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-3)
    assert torch.equal(adv[3:], torch.zeros(3))  # a group that all scored the same carries no signal
    big = flow_grpo.advantages(torch.tensor([0.0] * 9 + [1.0]), group_size=10, clip=2.0)
    assert float(big.max()) == 2.0


def test_the_clipped_ratio_stops_the_gradient_outside_one_plus_minus_eps():
    old = torch.zeros(2, 1)
    adv = torch.tensor([1.0, -1.0])
    inside = torch.full((2, 1), 5e-5, requires_grad=True)  # ratio 1 + 5e-5: inside eps 1e-4
    flow_grpo.flow_grpo_loss(inside, old, adv, clip_eps=1e-4).loss.backward()
    # d/dlogp of -mean(A * ratio) = -A * ratio / 2
    assert torch.allclose(inside.grad.view(2), -adv * torch.exp(torch.tensor(5e-5)) / 2)
    outside = torch.full((2, 1), 1e-3, requires_grad=True)  # ratio 1 + 1e-3
    out = flow_grpo.flow_grpo_loss(outside, old, adv, clip_eps=1e-4)
    out.loss.backward()
    # A > 0 and ratio above 1 + eps: clipped, no gradient; A < 0: the unclipped (pessimistic) term keeps it
    assert outside.grad[0].item() == 0.0 and outside.grad[1].item() != 0.0 and out.clip_frac == 1.0


def test_the_kl_to_the_adapter_off_base_is_the_closed_form_and_zero_for_the_base_itself(rollout):
    toy, ids, traj = rollout
    j = 2
    with torch.no_grad():
        _, mean, std = flow_grpo.rescore(velocity_fn(toy, ids), traj, j)
        with adapter_disabled(toy.transformer):
            _, ref_mean, _ = flow_grpo.rescore(velocity_fn(toy, ids), traj, j)
    kl = flow_grpo.gaussian_kl(mean, ref_mean, std)  # [B]
    s = std.expand_as(mean)
    expected = torch.distributions.kl_divergence(torch.distributions.Normal(mean, s),
                                                 torch.distributions.Normal(ref_mean, s)).mean(dim=(1, 2, 3))
    assert torch.allclose(kl, expected, rtol=1e-5) and float(kl.min()) > 0
    assert torch.equal(flow_grpo.gaussian_kl(ref_mean, ref_mean, std), torch.zeros(12))
    out = flow_grpo.flow_grpo_loss(torch.zeros(12, 1), torch.zeros(12, 1), torch.zeros(12), kl=kl.unsqueeze(1),
                                   kl_coef=0.5)
    assert out.kl == pytest.approx(float(kl.mean()), rel=1e-6)
    assert float(out.loss) == pytest.approx(0.5 * float(kl.mean()), rel=1e-6)  # A = 0: only the KL term is left
