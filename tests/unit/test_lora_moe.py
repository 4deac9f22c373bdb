"""The torch backend's LoRA on a transformers-5 Qwen3-MoE: the fused experts (3-D parameters) and the router
(a bare weight) get adapters through `lora.params.LoRAParam`, in PEFT's `target_parameters` layout.

What a user relies on: the model trains the expert / router adapters it was asked for; the HF-PEFT export
(`adapter_tensors` + `peft_config_dict`) loads with `PeftModel.from_pretrained` and gives the trainer's logits;
Merge mode's `folded_state` in a plain HF model gives them too; the adapter switched off gives the base.
The reference is peft itself, so a wrong grouped layout (expert-major vs rank-major) fails here.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from kora_trainer.checkpoint.peft_export import export_peft
from kora_trainer.config import LoRASpec
from kora_trainer.lora import adapter_disabled, adapter_parameters, adapter_tensors, apply_lora, folded_state
from kora_trainer.lora.model import peft_config_dict
from kora_trainer.lora.params import LoRAParam
from tinymodel import tiny_moe_config, tiny_moe_model

TOL = 1e-5  # fp32, no near-tie in the router (weights N(0, 0.2))
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4], [6, 6, 2, 8, 1, 30, 12, 5]])


def spec(*targets: str, mode: str = "Adapter") -> LoRASpec:
    return LoRASpec(rank=4, alpha=8, targetModules=list(targets), syncMode=mode)


def adapted(targets: tuple[str, ...], seed: int = 1):
    """The tiny MoE (layer 1 dense) with LoRA on `targets`, every B random so the adapter moves the logits."""
    cfg = tiny_moe_config()
    model = tiny_moe_model(cfg)
    names = apply_lora(model, spec(*targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return cfg, model, names


@pytest.fixture(scope="module")
def everything():
    return adapted(("linear_qkv", "linear_fc1", "linear_fc2", "router"))


def test_experts_and_router_are_wrapped_in_peft_layout(everything):
    cfg, model, names = everything
    e, r = cfg.num_experts, 4
    assert "model.layers.0.mlp.experts" in names and "model.layers.0.mlp.gate" in names
    assert "model.layers.1.mlp.gate_proj" in names  # the dense layer's MLP is a Linear
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, LoRAParam) and experts.param_name == "down_proj"
    assert experts.base_layer.param_name == "gate_up_proj"  # PEFT nests gate_up inside down
    assert tuple(experts.base_layer.lora_A.weight.shape) == (e * r, cfg.hidden_size)
    assert tuple(experts.base_layer.lora_B.weight.shape) == (2 * cfg.moe_intermediate_size, r * e)
    names_out = dict(adapter_tensors(model))
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight" in names_out
    assert "base_model.model.model.layers.0.mlp.gate.lora_B.weight" in names_out
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_export_loads_in_peft_and_gives_the_trainers_logits(everything, tmp_path):
    cfg, model, _ = everything
    with torch.no_grad():
        ours = model(IDS).logits
        with adapter_disabled(model):
            base = model(IDS).logits
    assert (ours - base).abs().max() > 0.1  # the adapter (experts, router included) moves the logits
    config = peft_config_dict(model, spec("linear_qkv"), str(tmp_path / "base"))
    assert config["target_parameters"][:2] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert "model.layers.0.mlp.gate.weight" in config["target_parameters"]
    assert "model.layers.1.mlp.gate_proj.weight" in config["target_parameters"]
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj"}
    out = export_peft(tmp_path, dict(adapter_tensors(model)), config, {})
    reference = PeftModel.from_pretrained(tiny_moe_model(cfg), str(out))
    with torch.no_grad():
        theirs = reference(IDS).logits
    assert (theirs - ours).abs().max() < TOL


def test_merge_mode_folded_state_is_the_policy():
    cfg, model, _ = adapted(("linear_qkv", "linear_fc1", "linear_fc2"))
    plain = tiny_moe_model(cfg)
    folded = dict(folded_state(model))
    assert "model.layers.0.mlp.experts.gate_up_proj" in folded and not any("lora_" in n for n in folded)
    plain.load_state_dict(folded, strict=True)
    with torch.no_grad():
        assert (plain(IDS).logits - model(IDS).logits).abs().max() < TOL


def test_only_the_requested_expert_parameter_is_wrapped_and_it_learns():
    _, model, names = adapted(("linear_fc2",))
    assert sorted(names) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.down_proj", "model.layers.2.mlp.experts"]
    experts = model.model.layers[0].mlp.experts
    assert experts.param_name == "down_proj" and not isinstance(experts.base_layer, LoRAParam)
    model.train()
    model(IDS, labels=IDS).loss.backward()
    assert float(experts.lora_A.weight.grad.abs().sum()) > 0 and float(experts.lora_B.weight.grad.abs().sum()) > 0


def test_merge_push_speaks_per_expert_names_and_carries_the_policy():
    """What Merge mode sends: the experts one by one under checkpoint names (SGLang's load_weights takes those,
    not transformers 5's fused tensors); fused back, they are the trainer's policy."""
    from kora_trainer.hf_experts import fuse_hf_experts
    from kora_trainer.sync.sources import merged_source

    cfg, model, _ = adapted(("linear_qkv", "linear_fc1", "linear_fc2"))
    src = merged_source(model)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in src.names
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in src.names)
    plain = tiny_moe_model(cfg)
    plain.load_state_dict(fuse_hf_experts(src.get(src.names)), strict=True)
    with torch.no_grad():
        assert (plain(IDS).logits - model(IDS).logits).abs().max() < TOL
