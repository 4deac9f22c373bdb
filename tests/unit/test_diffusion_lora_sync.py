"""LoRA IPC merge's two halves on the diffusion toy: PEFT names -> sglang-diffusion names, buckets that never split
a layer's A/B pair, and the engine's fold into a pristine base equal to the trainer's own fp32 fold."""

from __future__ import annotations

import pytest
import torch

from diffusionkit import toy_with_moved_adapter
from kora_engine.diffusion.stacked_fold import StackedFolds
from kora_trainer.lora.model import adapter_tensors, base_state, folded_state
from kora_trainer.toys.diffusion import load_diffusion_toy
from kora_trainer.wire.diffusion_lora import (
    LayerGroup,
    fold_from_pristine,
    layer_groups,
    pack_pair_buckets,
    sgld_name,
    split_pairs,
    sync_log_line,
)


def _named(buckets):
    return [[t for g in bucket for t in g.named()] for bucket in buckets]


def test_peft_names_map_to_the_engines_layer_names():
    assert sgld_name("base_model.model.transformer_blocks.0.attn.to_q.lora_A.weight") == \
        "transformer_blocks.0.attn.to_q.lora_A"
    assert sgld_name("base_model.model.transformer_blocks.1.attn.to_out.0.lora_B.default.weight") == \
        "transformer_blocks.1.attn.to_out.0.lora_B"  # an adapter name (PeftModel's own state dict) dropped too
    assert sgld_name("base_model.model.transformer_blocks.0.attn.to_q.base_layer.weight") is None


def test_the_toys_adapter_groups_into_its_fifteen_layers_with_nothing_unmapped(diffusion_toy_dir):
    toy = toy_with_moved_adapter(diffusion_toy_dir)
    groups, unmapped = layer_groups(adapter_tensors(toy.transformer))
    assert len(groups) == 15 and unmapped == []
    assert groups[0].prefix == "transformer_blocks.0.attn.to_q" and groups[0].a.shape == (4, 64)
    buckets = pack_pair_buckets(groups, cap_bytes=4 * groups[0].nbytes)
    assert sync_log_line(1, "transformer", buckets, len(unmapped)) == \
        "LoRA IPC weight sync v1 [transformer]: pushed 30 lora tensors, 15 layer prefixes in 4 buckets (unmapped=0)"
    with pytest.raises(ValueError, match="without their partner"):
        layer_groups(adapter_tensors(toy.transformer)[:-1])


def _groups_of_mixed_sizes():
    gen = torch.Generator().manual_seed(0)
    return [LayerGroup(f"transformer_blocks.{i}.attn.to_q", torch.randn(r, 16, generator=gen),
                       torch.randn(24, r, generator=gen)) for i, r in enumerate([1, 4, 2, 8, 3, 1, 16, 5, 2, 7])]


def _per_tensor_buckets(groups, cap):
    """A packer that walks tensors instead of layer groups: what the pair rule forbids (the check must see it)."""
    buckets, current, size = [], [], 0
    for name, t in (nt for g in groups for nt in g.named()):
        if current and size + t.numel() * t.element_size() > cap:
            buckets.append(current)
            current, size = [], 0
        current.append((name, t))
        size += t.numel() * t.element_size()
    return buckets + ([current] if current else [])


def test_no_bucket_splits_a_pair_at_any_cap_and_the_check_catches_a_packer_that_would():
    groups = _groups_of_mixed_sizes()
    total = sum(g.nbytes for g in groups)
    caught = 0
    for cap in [1, 100, 257, 700, 1000, 1999, 3000, total - 1, total, 10 * total]:
        buckets = pack_pair_buckets(groups, cap)
        assert split_pairs(_named(buckets)) == [], cap
        assert [g.prefix for b in buckets for g in b] == [g.prefix for g in groups]  # each once, in order
        for b in buckets:  # over the cap only when one group alone is larger than it
            assert sum(g.nbytes for g in b) <= cap or len(b) == 1
        caught += bool(split_pairs(_per_tensor_buckets(groups, cap)))
    assert caught >= 5  # the per-tensor packer splits pairs at most of these caps, and split_pairs says so
    with pytest.raises(ValueError, match=r"sync.bufferSize 0"):
        pack_pair_buckets(groups, 0)


def test_the_engines_fold_into_its_pristine_base_equals_the_trainers_fp32_fold(diffusion_toy_dir):
    toy = toy_with_moved_adapter(diffusion_toy_dir)  # rank 4, alpha 8
    pristine = {n: t.clone() for n, t in base_state(toy.transformer)}
    live = dict(pristine)
    groups, _ = layer_groups(adapter_tensors(toy.transformer))
    for bucket in _named(pack_pair_buckets(groups, cap_bytes=3 * groups[0].nbytes)):
        live.update(fold_from_pristine(pristine, bucket, lora_alpha=8, lora_rank=4))
    trainer = dict(folded_state(toy.transformer))
    assert live.keys() == trainer.keys()
    assert all(torch.equal(live[n], trainer[n]) for n in trainer)  # fp32: bit-equal, adapted or not
    assert not torch.equal(live["transformer_blocks.0.attn.to_q.weight"],
                           pristine["transformer_blocks.0.attn.to_q.weight"])
    # a second sync of the same adapter leaves the same weights: the fold starts from the pristine copy each time
    again = fold_from_pristine(pristine, groups[0].named(), lora_alpha=8, lora_rank=4)
    assert torch.equal(again["transformer_blocks.0.attn.to_q.weight"], live["transformer_blocks.0.attn.to_q.weight"])
    # folding into the live weight instead would add the delta twice
    drifted = fold_from_pristine(live, groups[0].named(), lora_alpha=8, lora_rank=4)
    assert not torch.allclose(drifted["transformer_blocks.0.attn.to_q.weight"],
                              live["transformer_blocks.0.attn.to_q.weight"])


def test_the_engines_stacked_folds_equal_the_layer_by_layer_fold_and_a_bad_bucket_changes_no_weight(
        diffusion_toy_dir):
    """kora_engine/diffusion/stacked_fold.py, as the engine uses it: the model's adapted weights become views of one
    stack per shape, a fold writes them all at once, bit-equal on the CPU to fold_from_pristine and to the
    trainer's fold."""
    toy = toy_with_moved_adapter(diffusion_toy_dir)  # rank 4, alpha 8
    engine = load_diffusion_toy(diffusion_toy_dir).transformer
    params = dict(engine.named_parameters())
    pristine = {n: p.detach().clone() for n, p in params.items()}
    reference = {n: t.clone() for n, t in pristine.items()}
    folds = StackedFolds(params, pristine)
    groups, _ = layer_groups(adapter_tensors(toy.transformer))
    trainer = dict(folded_state(toy.transformer))
    for order in (groups, groups[::-1]):  # a bucket of another layer order re-plans
        bucket = _named([order])[0]
        assert folds.apply(bucket, lora_alpha=8, lora_rank=4) == len(groups)
        want = fold_from_pristine(reference, bucket, lora_alpha=8, lora_rank=4)
        assert all(torch.equal(params[k], w) and torch.equal(params[k], trainer[k]) for k, w in want.items())
        assert all(torch.equal(pristine[k], reference[k]) for k in reference)  # the bases stay as loaded
    q = params["transformer_blocks.0.attn.to_q.weight"]
    assert len({params[f"{g.prefix}.weight"].untyped_storage().data_ptr() for g in groups}) < len(groups)
    assert q.untyped_storage().nbytes() > q.nbytes  # a view of its shape group's stack: the model computes with it
    before = {n: p.detach().clone() for n, p in params.items()}
    wrong = [(f"{groups[1].prefix}.lora_A", groups[1].a), (f"{groups[1].prefix}.lora_B", groups[1].b[:, :2])]
    with pytest.raises(ValueError, match=r"does not fold into its weight"):
        folds.apply([*groups[0].named(), *wrong], lora_alpha=0.0, lora_rank=4)
    assert all(torch.equal(params[n], before[n]) for n in params)  # the good first pair was not written either


def test_a_bf16_base_folds_in_fp32_and_rounds_once():
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(32, 16, generator=gen).to(torch.bfloat16)
    a, b = torch.randn(4, 16, generator=gen) * 0.1, torch.randn(32, 4, generator=gen) * 0.1
    pair = [("layer.lora_A", a.to(torch.bfloat16)), ("layer.lora_B", b.to(torch.bfloat16))]
    fp32 = fold_from_pristine({"layer.weight": w0}, pair, 8, 4, fp32=True)["layer.weight"]
    exact = (w0.float() + 2 * (pair[1][1].float() @ pair[0][1].float())).to(torch.bfloat16)
    assert fp32.dtype == torch.bfloat16 and torch.equal(fp32, exact)
    low = fold_from_pristine({"layer.weight": w0}, pair, 8, 4, fp32=False)["layer.weight"]
    assert not torch.equal(low, exact)  # the low-precision merge rounds B A and the sum separately
    with pytest.raises(ValueError, match="whole A/B pairs"):
        fold_from_pristine({"layer.weight": w0}, pair[:1], 8, 4)
    with pytest.raises(KeyError, match=r"other\.weight"):
        fold_from_pristine({"layer.weight": w0}, [("other.lora_A", a), ("other.lora_B", b)], 8, 4)
