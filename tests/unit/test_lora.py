"""LoRA for HF models: the injected policy equals peft's, the fold equals peft's merge, scope and
freezing behave. Real models written to disk by tests/tinymodel.py and loaded with from_pretrained."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

pytest.importorskip("peft")

from kora_trainer.config import LoRASpec
from kora_trainer.lora import (
    adapter_disabled,
    adapter_parameters,
    adapter_tensors,
    apply_lora,
    check_only_adapters_trainable,
    folded_state,
    peft_config_dict,
    select_targets,
)
from tinymodel import make_tiny_model

ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
ATOL = 1e-5  # fp32, same tensors, same math up to summation order
IDS = torch.tensor([[1, 4, 5, 13, 6, 7, 14, 5, 6], [1, 12, 13, 3, 14, 9, 9, 9, 2]])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def lora_policy(model_dir, spec, seed=0):
    model = load(model_dir)
    apply_lora(model, spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model):  # B = 0 at init would hide every bug: make both non-zero
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def save_peft_dir(model, spec, model_dir, out):
    from safetensors.torch import save_file

    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(peft_config_dict(model, spec, str(model_dir))))
    save_file({k: v.contiguous() for k, v in adapter_tensors(model)}, str(out / "adapter_model.safetensors"))
    return out


def test_injection_freezes_base_and_starts_as_identity(model_dir):
    spec = LoRASpec(rank=4, alpha=8, target_modules=ALL)
    base, model = load(model_dir), load(model_dir)
    wrapped = apply_lora(model, spec)
    assert len(wrapped) == 2 * 7  # q, k, v, o, gate, up, down per layer
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    check_only_adapters_trainable(model)
    # B = 0 at init: the policy is the base, exactly
    torch.testing.assert_close(model(input_ids=IDS).logits, base(input_ids=IDS).logits, rtol=0, atol=0)
    a = model.model.layers[0].self_attn.q_proj.lora_A.weight
    assert a.abs().sum() > 0 and model.model.layers[0].self_attn.q_proj.lora_B.weight.abs().sum() == 0


def test_policy_equals_peft_loaded_from_export(model_dir, tmp_path):
    from peft import PeftModel

    spec = LoRASpec(rank=4, alpha=16, target_modules=["linear_qkv", "linear_proj", "linear_fc2"])
    model = lora_policy(model_dir, spec)
    saved = save_peft_dir(model, spec, model_dir, tmp_path / "a")
    peft_model = PeftModel.from_pretrained(load(model_dir), saved).eval()
    with torch.no_grad():
        ours, theirs = model(input_ids=IDS).logits, peft_model(input_ids=IDS).logits
        base = load(model_dir)(input_ids=IDS).logits
    assert (ours - base).abs().max() > 1e-2  # the adapter matters, so the comparison can fail
    torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL)
    with torch.no_grad(), adapter_disabled(model):  # the KL reference: adapters off = the base model
        torch.testing.assert_close(model(input_ids=IDS).logits, base, rtol=0, atol=ATOL)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, ours, rtol=0, atol=0)  # switched back on


def test_fold_equals_peft_merge_and_unload(model_dir):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    spec = LoRASpec(rank=8, alpha=32, target_modules=ALL)
    model = lora_policy(model_dir, spec, seed=3)
    cfg = peft_config_dict(model, spec, str(model_dir))
    peft_model = get_peft_model(load(model_dir), LoraConfig(**{k: v for k, v in cfg.items() if k != "peft_type"}))
    loaded = set_peft_model_state_dict(peft_model, dict(adapter_tensors(model)))  # HF-PEFT names, as saved
    assert not loaded.unexpected_keys
    merged = peft_model.merge_and_unload().state_dict()
    folded = dict(folded_state(model))
    assert set(folded) <= set(merged)
    assert "model.layers.0.self_attn.q_proj.weight" in folded and "model.embed_tokens.weight" in folded
    for name, t in folded.items():
        torch.testing.assert_close(t, merged[name], rtol=0, atol=1e-6, msg=name)
    fresh = load(model_dir)
    fresh.load_state_dict(folded, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=ATOL)


def test_dropout_only_in_training(model_dir):
    spec = LoRASpec(rank=4, alpha=8, dropout=0.5, target_modules=ALL)
    model = lora_policy(model_dir, spec)
    with torch.no_grad():
        eval_a, eval_b = model(input_ids=IDS).logits, model(input_ids=IDS).logits
        model.train()
        train = model(input_ids=IDS).logits
    torch.testing.assert_close(eval_a, eval_b, rtol=0, atol=0)
    assert (train - eval_a).abs().max() > 1e-3


class _VisionLanguage(nn.Module):
    """The module paths of a VL model: a vision tower and a projector beside the language layers."""

    def __init__(self):
        super().__init__()
        self.visual = nn.ModuleDict({"blocks": nn.ModuleList([nn.ModuleDict({"q_proj": nn.Linear(4, 4)})])})
        self.multi_modal_projector = nn.ModuleDict({"o_proj": nn.Linear(4, 4)})
        self.model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict(
            {"q_proj": nn.Linear(4, 4), "o_proj": nn.Linear(4, 4), "up_proj": nn.Linear(4, 4)})])})


@pytest.mark.parametrize(("scope", "expected"), [
    ("all", ["visual.blocks.0.q_proj", "multi_modal_projector.o_proj",
             "model.layers.0.q_proj", "model.layers.0.o_proj"]),
    ("language", ["model.layers.0.q_proj", "model.layers.0.o_proj"]),
    ("vision", ["visual.blocks.0.q_proj", "multi_modal_projector.o_proj"]),
])
def test_scope_selects_regions(scope, expected):
    assert select_targets(_VisionLanguage(), ["linear_qkv", "linear_proj"], scope) == expected


def test_language_scope_exports_full_paths():
    model = _VisionLanguage()
    spec = LoRASpec(rank=2, target_modules=["linear_qkv"], scope="language")
    apply_lora(model, spec)
    cfg = peft_config_dict(model, spec, None)
    assert cfg["target_modules"] == ["model.layers.0.q_proj"]  # a bare q_proj would hit the vision tower in peft
    assert not model.visual.blocks[0].q_proj.weight.requires_grad  # base frozen everywhere


def test_no_match_is_an_error(model_dir):
    with pytest.raises(ValueError, match="matched no Linear"):
        apply_lora(load(model_dir), LoRASpec(rank=2, target_modules=["router"]))


def test_targets_that_match_nothing_are_refused_not_silently_dropped():
    """A dense model has no router: asking for one must fail, not train attention alone as if it were done.
    (MoE experts and routers are wrapped on an MoE model: tests/unit/test_lora_moe.py.)"""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    spec = LoRASpec(rank=2, target_modules=["linear_qkv", "router"])
    with pytest.raises(ValueError, match=r"\['router'\] matched no Linear layer or MoE parameter"):
        apply_lora(model, spec)
    assert apply_lora(model, LoRASpec(rank=2, target_modules=["linear_qkv"]))  # attention alone is fine
