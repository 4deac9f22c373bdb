"""The torch actor: real from_pretrained loading, LoRA applied, log-probs, GRPO steps that move the policy
the way the rewards say, with the base untouched and only the adapter in the optimizer."""

from __future__ import annotations

import pytest
import torch

from kora_trainer.backends.batch import RolloutBatch, pad
from kora_trainer.backends.logprobs import sequence_logp, shared_prefix_logp
from kora_trainer.backends.torch_backend import TorchBackend
from kora_trainer.config import load_config
from tinymodel import make_tiny_model

PROMPT = [1, 4, 5, 13, 6, 7, 14]
GOOD, BAD = [5, 6, 7, 2], [8, 8, 8, 2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def backend(model_dir, **over) -> TorchBackend:
    overrides = [f"model.path={model_dir}", "data.path=unused.parquet", "lora.rank=4", "lora.alpha=8",
                 "lora.syncMode=Merge", "algorithm.lr=0.02", "algorithm.innerEpochs=2",
                 *[f"{k}={v}" for k, v in over.items()]]
    cfg, _ = load_config(None, overrides, base={"lora": {"rank": 4}})
    return TorchBackend(cfg, device="cpu", threads=1)


def test_logprobs_match_a_plain_forward_and_start_at_the_base(model_dir):
    from transformers import AutoModelForCausalLM

    b = backend(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(ref(input_ids=torch.tensor([PROMPT + GOOD])).logits[0], -1)
    expected = [float(logp[len(PROMPT) - 1 + j, t]) for j, t in enumerate(GOOD)]
    for adapter in (True, False):  # B = 0 at init: with or without the adapter, the base policy
        got = b.logprobs([PROMPT, PROMPT[:5]], [GOOD, BAD[:2]], adapter=adapter)
        assert len(got[0]) == 4 and len(got[1]) == 2
        assert max(abs(x - y) for x, y in zip(got[0], expected, strict=True)) < 1e-5


def test_padding_layout():
    p = pad([[1, 2, 3], [1, 2]], [[7, 8], [9]], [[-0.5, -0.25], [-1.0]])
    assert p.response_ids.tolist() == [[7, 8], [9, 0]]
    assert p.response_mask.tolist() == [[1, 1], [1, 0]]
    assert p.rollout_logp.tolist() == [[-0.5, -0.25], [-1.0, 0.0]]


def test_shared_prefix_forward_equals_the_plain_one(model_dir):
    """Values and gradients: prompts of different lengths, responses of different lengths, groups of 3."""
    b = backend(model_dir)
    with torch.no_grad():
        for prm in b.params:
            prm.normal_(0.0, 0.1)
    prompts = [PROMPT] * 3 + [PROMPT[:4]] * 3
    responses = [GOOD, BAD[:2], [9], GOOD[:3], BAD, [2]]
    p = pad(prompts, responses)
    b.model.train()  # no dropout configured: train mode only to exercise that path
    plain = sequence_logp(b.model, p, b.pad_id)
    grads_plain = torch.autograd.grad(plain.sum(), b.params)
    shared = shared_prefix_logp(b.model, p, b.pad_id)
    grads_shared = torch.autograd.grad(shared.sum(), b.params)
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
    assert float((plain * (1 - p.response_mask)).abs().sum()) == 0.0  # padding contributes nothing
    for gp, gs in zip(grads_plain, grads_shared, strict=True):
        torch.testing.assert_close(gs, gp, rtol=1e-4, atol=1e-5)  # fp32 summation order


def test_grpo_steps_follow_the_reward_and_touch_only_the_adapter(model_dir):
    b = backend(model_dir)
    base_before = {n: p.detach().clone() for n, p in b.model.named_parameters() if not p.requires_grad}
    assert {id(p) for g in b.optimizer.param_groups for p in g["params"]} == {id(p) for p in b.params}
    start = b.logprobs([PROMPT], [GOOD])[0]
    for _ in range(4):
        # a group of 4: two rewarded GOOD responses, two unrewarded BAD ones; log-probs from the policy itself
        responses = [GOOD, BAD, GOOD, BAD]
        lps = b.logprobs([PROMPT] * 4, responses)
        metrics = b.train_step(RolloutBatch([PROMPT] * 4, responses, lps, [1.0, 0.0, 1.0, 0.0], group_size=4))
    after = b.logprobs([PROMPT], [GOOD])[0]
    assert sum(after) > sum(start) + 0.5
    assert metrics.version == 4 and metrics.updates == 2  # 2 inner epochs x 1 optimizer batch
    assert metrics.rollout_logp_gap_max < 1e-5  # rollout log-probs were the policy's own
    for n, p in b.model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), n


def test_kl_reference_is_the_base(model_dir):
    b = backend(model_dir, **{"algorithm.klCoef": 1.0})
    with torch.no_grad():
        for p in b.params:
            p.add_(0.1 * torch.randn_like(p))
    lps = b.logprobs([PROMPT] * 2, [GOOD, BAD])
    m = b.train_step(RolloutBatch([PROMPT] * 2, [GOOD, BAD], lps, [1.0, 0.0], group_size=2))
    assert m.kl > 0  # the adapted policy is away from the base: the k3 estimate sees it


def test_stale_rollouts_report_their_lag_not_a_gap(model_dir):
    """Async rollouts come from an older policy version: the trainer/engine gap is then not measured."""
    b = backend(model_dir)
    lps = b.logprobs([PROMPT] * 2, [GOOD, BAD])
    fresh = b.train_step(RolloutBatch([PROMPT] * 2, [GOOD, BAD], lps, [1.0, 0.0], 2, weight_versions=["0", "0"]))
    assert fresh.rollout_version_lag == 0 and fresh.rollout_logp_gap_max is not None
    stale = b.train_step(RolloutBatch([PROMPT] * 2, [GOOD, BAD], lps, [1.0, 0.0], 2, weight_versions=["0", "0"]))
    assert stale.rollout_version_lag == 1 and stale.rollout_logp_gap_max is None


def test_kl_to_base_is_measured_without_changing_the_update(model_dir):
    """tracking.klToBase measures the KL to the base at klCoef 0 (actor/kl_loss) and leaves the step as it was; the
    tracker statistics are the batch's own (reward spread, lengths) and the entropy estimate is -mean log π of the
    sampled tokens under the policy that sampled them."""
    runs = {}
    for measured in (False, True):
        torch.manual_seed(0)
        b = backend(model_dir, **{"tracking.klToBase": str(measured).lower()})
        with torch.no_grad():
            for p in b.params:
                p.add_(0.1 * torch.randn_like(p))
        lps = b.logprobs([PROMPT] * 2, [GOOD, BAD])
        runs[measured] = (b.train_step(RolloutBatch([PROMPT] * 2, [GOOD, BAD], lps, [1.0, 0.0], group_size=2)), lps)
    (off, lps), (on, _) = runs[False], runs[True]
    assert not off.kl_measured and off.kl == 0.0
    assert on.kl_measured and on.kl > 0  # the adapted policy is away from the base
    assert on.loss == off.loss and on.grad_norm == off.grad_norm  # klCoef 0: the loss does not include it
    assert (on.reward_min, on.reward_max) == (0.0, 1.0) and abs(on.reward_std - 0.5 ** 0.5) < 1e-6
    assert (on.response_len_min, on.response_len_max) == (4, 4) and on.lr == 0.02
    sampled = [x for lp in lps for x in lp]
    assert abs(on.entropy - (-sum(sampled) / len(sampled))) < 1e-5 and on.entropy > 0
    assert on.ppo_kl != 0.0  # two inner epochs: the second pass runs on an updated policy


def test_the_stale_gap_is_how_far_the_update_moved_the_sampled_tokens(model_dir):
    """stale_logp_gap_max is the serving check's resolution: after a step that moved the policy, an engine still on
    the old version would show this gap, far above the correct engine's (the rollout's own log-probs)."""
    b = backend(model_dir, **{"algorithm.lr": "0.05"})
    lps = b.logprobs([PROMPT] * 2, [GOOD, BAD])
    m = b.train_step(RolloutBatch([PROMPT] * 2, [GOOD, BAD], lps, [1.0, 0.0], 2, weight_versions=["0", "0"]))
    after = b.logprobs([PROMPT] * 2, [GOOD, BAD])
    moved = max(abs(x - y) for new, old in zip(after, lps, strict=True) for x, y in zip(new, old, strict=True))
    assert m.rollout_logp_gap_max < 1e-5 < m.stale_logp_gap_max
    assert m.stale_logp_gap_max == pytest.approx(moved, rel=1e-4)
    late = b.train_step(RolloutBatch([PROMPT] * 2, [GOOD, BAD], lps, [1.0, 0.0], 2, weight_versions=["0", "0"]))
    assert late.stale_logp_gap_max is None  # rollouts of an older version: no gap to compare
