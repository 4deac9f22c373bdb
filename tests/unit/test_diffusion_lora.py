"""LoRA on the diffusion toy's SD3 transformer: PEFT's module names, the base untouched at start, the adapter-off
switch (the KL reference), and a refused target."""

from __future__ import annotations

import pytest
import torch

from kora_trainer.lora.diffusers import SD3_TARGETS, apply_diffusion_lora, lora_module_names
from kora_trainer.lora.model import adapter_disabled, adapter_pairs, adapter_parameters, folded_state
from kora_trainer.toys.diffusion import load_diffusion_toy


def _velocity(toy, x):
    return toy.transformer(hidden_states=x, encoder_hidden_states=toy.encoder_hidden_states[:2],
                           pooled_projections=toy.pooled_projections[:2], timestep=torch.tensor([900.0, 300.0]),
                           return_dict=False)[0]


def test_the_adapted_modules_are_the_ones_peft_picks_for_the_same_targets(diffusion_toy_dir):
    from peft import LoraConfig, inject_adapter_in_model

    ours = load_diffusion_toy(diffusion_toy_dir).transformer
    names = apply_diffusion_lora(ours, rank=4, alpha=8, targets=SD3_TARGETS)
    theirs = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=list(SD3_TARGETS)),
                                     load_diffusion_toy(diffusion_toy_dir).transformer)
    peft_names = [n for n, m in theirs.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert names == lora_module_names(ours) == peft_names
    # 2 joint blocks x 8 targets, less the last block's to_add_out (SD3's context_pre_only block has none)
    assert len(names) == 15 and "transformer_blocks.1.attn.to_add_out" not in names
    assert "transformer_blocks.0.attn.to_out.0" in names and "transformer_blocks.0.attn.add_q_proj" in names
    (a_name, a), (b_name, b) = adapter_pairs(ours)[0]
    assert a_name == "base_model.model.transformer_blocks.0.attn.to_q.lora_A.weight"  # HF-PEFT's state-dict name
    assert b_name.endswith("to_q.lora_B.weight") and a.shape == (4, 64) and b.shape == (64, 4)


def test_a_new_adapter_leaves_the_base_policy_and_trains_only_itself(diffusion_toy_dir):
    toy = load_diffusion_toy(diffusion_toy_dir)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = _velocity(toy, x)
    apply_diffusion_lora(toy.transformer, rank=4, alpha=8, init="gaussian")
    a = adapter_parameters(toy.transformer)[0]
    assert abs(float(a.detach().std()) - 0.25) < 0.08  # gaussian init: A ~ N(0, 1/r), r = 4
    with torch.no_grad():
        assert torch.equal(_velocity(toy, x), base)  # B = 0
    trainable = [n for n, p in toy.transformer.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    with torch.no_grad():
        for p in adapter_parameters(toy.transformer):
            p.add_(0.05)
        moved = _velocity(toy, x)
        with adapter_disabled(toy.transformer):
            off = _velocity(toy, x)
    assert not torch.allclose(moved, base, atol=1e-4) and torch.equal(off, base)
    folded = dict(folded_state(toy.transformer))  # Merge's view: W + (alpha/r) B A under diffusers' own names
    assert "transformer_blocks.0.attn.to_q.weight" in folded and not any("lora_" in n for n in folded)


def test_a_target_that_matches_nothing_is_refused_with_the_names_to_use(diffusion_toy_dir):
    toy = load_diffusion_toy(diffusion_toy_dir)
    with pytest.raises(ValueError, match=r"diffusion.targetModules \['q_proj'\] matched no nn.Linear.*to_out.0"):
        apply_diffusion_lora(toy.transformer, rank=4, alpha=8, targets=["to_q", "q_proj"])
    with pytest.raises(ValueError, match="lora init 'kaiming'"):
        apply_diffusion_lora(toy.transformer, rank=4, alpha=8, init="kaiming")
