"""GDN LoRA without an engine: what `in_proj` / `out_proj` wrap on transformers 5's Qwen3.5 GDN layers, the
Adapter-mode gate pin (zero gradient, zero contribution), when it applies, and the SGLang names of a push read back
onto the HF modules (the reference engine's side) giving the same product row for row."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gdnkit import make_tiny_gdn_model
from kora_trainer.config import LoRASpec, SyncMode
from kora_trainer.config.engine_lora_limits import SGLANG_MILES_GDN_GATES, STOCK_SGLANG, gdn_gate_mask_needed
from kora_trainer.lora import adapter_pairs, apply_lora, lora_modules
from kora_trainer.lora.gdn import pin_gate_rows
from kora_trainer.wire.gdn_lora import hf_pairs, to_sglang_config, to_sglang_pairs
from kora_trainer.wire.lora_names import split_lora_name

GDN = "model.layers.0.linear_attn"


@pytest.fixture(scope="module")
def gdn_dir(tmp_path_factory):
    return make_tiny_gdn_model(tmp_path_factory.mktemp("gdn") / "gdn")


def wrapped(gdn_dir, targets=("in_proj", "out_proj")):
    model = AutoModelForCausalLM.from_pretrained(gdn_dir, dtype=torch.float32)
    apply_lora(model, LoRASpec(rank=4, alpha=8, target_modules=list(targets)))
    return model


def test_in_proj_and_out_proj_wrap_the_gdn_projections_only(gdn_dir):
    model = wrapped(gdn_dir)
    names = sorted(lora_modules(model))
    leaves = ["in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z", "out_proj"]
    assert names == [f"model.layers.{i}.linear_attn.{leaf}" for i in (0, 2) for leaf in leaves]  # layer 1 is attention


def test_pinned_gates_get_zero_gradient_and_add_nothing(gdn_dir):
    torch.manual_seed(0)
    model = wrapped(gdn_dir)
    mods = lora_modules(model)
    with torch.no_grad():
        for m in mods.values():
            m.lora_B.weight.normal_(0, 0.3)
    ids = torch.tensor([[1, 4, 5, 13, 6, 7, 14, 3]])
    assert sorted(pin_gate_rows(model)) == sorted(n for n in mods if n.endswith(("in_proj_b", "in_proj_a")))
    gates = [m for n, m in mods.items() if n.endswith(("in_proj_b", "in_proj_a"))]
    out = model(input_ids=ids).logits
    for m in gates:  # the pinned adapters off: the same forward, exactly
        m.enabled = False
    assert torch.equal(model(input_ids=ids).logits, out)
    for m in gates:
        m.enabled = True
    out.logsumexp(-1).sum().backward()
    opt = torch.optim.AdamW([p for m in mods.values() for p in m.parameters() if p.requires_grad], lr=0.1)
    opt.step()
    for m in gates:
        assert not m.lora_A.weight.grad.any() and not m.lora_B.weight.grad.any()
        assert not m.lora_B.weight.any() and not m.folded_weight().sub(m.base_layer.weight).any()
    assert all(m.lora_B.weight.grad.any() for n, m in mods.items() if n.endswith(("in_proj_qkv", "out_proj")))


def test_the_gate_pin_is_for_adapter_mode_on_builds_without_gate_adapters():
    stock = STOCK_SGLANG.gdn_gate_adapters
    assert gdn_gate_mask_needed(SyncMode.ADAPTER) and gdn_gate_mask_needed(SyncMode.ADAPTER, stock)
    assert not gdn_gate_mask_needed(SyncMode.ADAPTER, SGLANG_MILES_GDN_GATES.gdn_gate_adapters)
    assert not gdn_gate_mask_needed(SyncMode.MERGE) and not gdn_gate_mask_needed(SyncMode.ENGINE_MERGE)


def _products(pairs: dict) -> dict:
    return {m: b.double() @ a.double() for m, (a, b) in pairs.items()}


def _width(model):
    mods = dict(model.named_modules())
    return lambda m: mods[m].out_features if isinstance(mods.get(m), torch.nn.Linear) else None


def test_a_push_under_sglang_names_reads_back_to_the_same_adapter(gdn_dir):
    torch.manual_seed(1)
    model = wrapped(gdn_dir)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.normal_(0, 0.3)
    pin_gate_rows(model)
    pushed = to_sglang_pairs(adapter_pairs(model), gate_adapters=False)
    names = [a for (a, _), _ in pushed]
    assert f"base_model.model.{GDN}.in_proj_q.lora_A.weight" in names and f"{GDN}.in_proj_qkv." not in str(names)
    assert not [n for n in names if ".in_proj_b." in n or ".in_proj_a." in n]
    on_wire = {split_lora_name(a)[0]: (ta, tb) for (a, ta), (_, tb) in pushed}
    back, stacked = hf_pairs(on_wire, _width(model), gate_adapters=False)
    assert stacked[f"{GDN}.in_proj_qkv"] == 3
    want = {n: (m.lora_A.weight, m.lora_B.weight) for n, m in lora_modules(model).items()
            if not n.endswith(("in_proj_b", "in_proj_a"))}
    got, exp = _products(back), _products(want)
    assert got.keys() == exp.keys()
    assert all(torch.allclose(got[k], exp[k], atol=1e-12) for k in exp)


def test_sglang_prefused_modules_split_onto_the_hf_modules(gdn_dir):
    model = AutoModelForCausalLM.from_pretrained(gdn_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 64, generator=g), torch.randn(128 + 64, 4, generator=g)
    ab_a, ab_b = torch.randn(4, 64, generator=g), torch.randn(8, 4, generator=g)
    fused = {f"{GDN}.in_proj_qkvz": (a, b), f"{GDN}.in_proj_ba": (ab_a, ab_b)}
    back, _ = hf_pairs(fused, _width(model), gate_adapters=True)
    assert torch.equal(back[f"{GDN}.in_proj_qkv"][1], b[:128]) and torch.equal(back[f"{GDN}.in_proj_z"][1], b[128:])
    assert torch.equal(back[f"{GDN}.in_proj_b"][1], ab_b[:4]) and torch.equal(back[f"{GDN}.in_proj_a"][1], ab_b[4:])


def test_a_gate_adapter_the_build_cannot_serve_is_refused_not_dropped(gdn_dir):
    model = AutoModelForCausalLM.from_pretrained(gdn_dir, dtype=torch.float32)
    a, b = torch.randn(4, 64), torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"in_proj_b: this engine build carries no LoRA on GDN gate.*syncMode Merge"):
        hf_pairs({f"{GDN}.in_proj_b": (a, b)}, _width(model), gate_adapters=False)
    zero, _ = hf_pairs({f"{GDN}.in_proj_b": (a, torch.zeros(4, 4))}, _width(model), gate_adapters=False)
    assert zero == {}  # a pinned (all-zero) gate adds nothing: dropped, as a PEFT export of Adapter mode holds one
    kept, _ = hf_pairs({f"{GDN}.in_proj_b": (a, b)}, _width(model), gate_adapters=True)
    assert list(kept) == [f"{GDN}.in_proj_b"]


def test_the_pushed_config_names_sglang_modules():
    config = {"r": 4, "target_modules": ["in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z", "out_proj", "q_proj"]}
    assert to_sglang_config(config, gate_adapters=False)["target_modules"] == ["in_proj_qkvz", "out_proj", "q_proj"]
    assert to_sglang_config(config, gate_adapters=True)["target_modules"] == ["in_proj_ba", "in_proj_qkvz", "out_proj",
                                                                             "q_proj"]
    path = "model.language_model.layers.0.linear_attn"
    scoped = {"target_modules": [f"{path}.in_proj_z"]}
    assert to_sglang_config(scoped, False)["target_modules"] == [f"{path}.in_proj_qkvz"]
