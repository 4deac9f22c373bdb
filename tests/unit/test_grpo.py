"""GRPO math: group-normalised advantages, the clipped token-level loss, the k3 KL, micro-batching."""

from __future__ import annotations

import torch

from kora_trainer.algorithm.grpo import group_advantages, grpo_loss


def test_advantages_are_normalised_within_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # 2 groups of 4
    adv = group_advantages(rewards, 4)
    g0 = adv[:4]
    assert abs(float(g0.mean())) < 1e-6 and abs(float(g0.std()) - 1.0) < 1e-4
    assert g0[0] > 0 > g0[1]
    assert torch.all(adv[4:] == 0)  # an all-correct group carries no signal
    unscaled = group_advantages(rewards, 4, scale_by_std=False)
    torch.testing.assert_close(unscaled[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_on_policy_gradient_is_advantage_weighted_logprob():
    torch.manual_seed(0)
    logp = (torch.randn(3, 5) - 2).requires_grad_()  # [B, T]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0])
    out = grpo_loss(logp, logp.detach(), adv, mask)  # ratio == 1: nothing is clipped
    out.loss.backward()
    expected = -adv[:, None] * mask / mask.sum()  # d/dlogp of −A·ratio, ratio = exp(logp − old)
    torch.testing.assert_close(logp.grad, expected.float())
    assert out.clip_frac == 0.0 and abs(out.ratio_mean - 1.0) < 1e-6


def test_clipping_stops_the_gradient_past_the_trust_region():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, -0.5]], requires_grad=True)  # ratios e^0.5 ≈ 1.65, e^-0.5 ≈ 0.61
    out = grpo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2)
    out.loss.backward()
    # positive advantage: the token already above 1+eps is clipped (no push further up), the one below
    # 1−eps is not (min picks the unclipped, smaller term) and still gets pushed up
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] < 0
    assert out.clip_frac == 1.0


def test_k3_kl_is_zero_at_reference_and_positive_elsewhere():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask, adv = torch.ones(1, 2), torch.zeros(1)
    same = grpo_loss(logp, logp.detach(), adv, mask, ref_logp=logp.detach(), kl_coef=0.5)
    assert same.kl == 0.0
    moved = grpo_loss(logp, logp.detach(), adv, mask, ref_logp=logp.detach() - 0.3, kl_coef=0.5)
    d = torch.tensor(-0.3)
    assert abs(moved.kl - float(torch.exp(d) - d - 1)) < 1e-6
    moved.loss.backward()
    assert torch.all(logp.grad > 0)  # the penalty pulls the policy back down towards the reference


def test_micro_batches_accumulate_to_the_full_batch_gradient():
    torch.manual_seed(1)
    logp = torch.randn(4, 6, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(4, 6)
    adv = torch.randn(4)
    mask = (torch.rand(4, 6) > 0.3).float()
    full = torch.autograd.grad(grpo_loss(logp, old, adv, mask).loss, logp)[0]
    n = float(mask.sum())
    acc = torch.zeros_like(logp)
    for sl in (slice(0, 1), slice(1, 4)):
        acc += torch.autograd.grad(grpo_loss(logp[sl], old[sl], adv[sl], mask[sl], num_tokens=n).loss, logp)[0]
    torch.testing.assert_close(acc, full)
