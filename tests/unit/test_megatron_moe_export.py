"""The megatron backend's HF-PEFT export of a Qwen3-MoE adapter (attention, dense-MLP, expert and router LoRA),
on the CPU without megatron-core: the wrappers are `MegatronLoRA` around plain Linears standing in for megatron's
modules (export reads only their names and factors), megatron's TP gather is the identity (TP = 1).

The exported directory must load with `peft.PeftModel.from_pretrained` on HF's Qwen3MoeForCausalLM and give the
logits of the HF model with every megatron update folded in by hand (B·A per expert into `gate_up_proj[e]` /
`down_proj[e]`, into the router's `mlp.gate.weight`, split out of the fused QKV / [gate; up] rows), and load back
into the wrappers bit for bit. The GPU test (tests/gpu/test_megatron_moe.py) checks the same against a real
megatron model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from torch import nn

from kora_trainer.backends.megatron import export, parallel
from kora_trainer.backends.megatron.convert import REPL, Layout, adapter_modules, layout_from_hf_config, split_qkv
from kora_trainer.backends.megatron.lora import MegatronLoRA
from kora_trainer.config import LoRASpec
from tinymodel import make_tiny_moe, tiny_moe_model

R, ALPHA = 4, 8.0
TOL = 1e-4  # fp32; the router's top-k must pick the same experts on both sides (weights N(0, 0.2): no near-tie)


@pytest.fixture(autouse=True)
def tp1(monkeypatch):
    monkeypatch.setattr(export, "gather_tp", lambda t: [t])
    monkeypatch.setattr(parallel, "tp_rank_size", lambda: (0, 1))
    monkeypatch.setattr(parallel, "ep_rank_size", lambda: (0, 1))
    monkeypatch.setattr(parallel, "pp_rank_size", lambda: (0, 1))


def megatron_shapes(cfg, layout: Layout) -> dict[str, tuple[int, int]]:
    """Every LoRA-able megatron module of the model -> its weight's [out, in] (what `apply_lora` would wrap)."""
    h, d, e = cfg.hidden_size, layout.head_dim, layout.num_experts
    out: dict[str, tuple[int, int]] = {}
    for i in range(layout.num_layers):
        p = f"decoder.layers.{i}."
        out[p + "self_attention.linear_qkv"] = ((layout.num_heads + 2 * layout.num_kv_heads) * d, h)
        out[p + "self_attention.linear_proj"] = (h, layout.num_heads * d)
        if i not in layout.moe_layers:
            mlps, inter = [p + "mlp."], cfg.intermediate_size
        else:
            out[p + "mlp.router"] = (e, h)
            mlps, inter = [f"{p}mlp.experts.local_experts.{x}." for x in range(e)], cfg.moe_intermediate_size
        for q in mlps:
            out[q + "linear_fc1"], out[q + "linear_fc2"] = (2 * inter, h), (h, inter)
    return out


def stand_in(shapes: dict[str, tuple[int, int]], leaves: set[str], seed: int) -> nn.Module:
    """A module tree with megatron's paths and a random MegatronLoRA wherever `leaves` says."""
    g = torch.Generator().manual_seed(seed)
    root = nn.Module()
    for name, (out_f, in_f) in shapes.items():
        if name.rsplit(".", 1)[-1] not in leaves:
            continue
        parent = root
        for part in name.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        m = MegatronLoRA(nn.Linear(in_f, out_f, bias=False), R, ALPHA, 0.0, torch.randn(R, in_f, generator=g) * 0.2)
        m.lora_B.weight.data.copy_(torch.randn(out_f, R, generator=g) * 0.2)
        parent.add_module(name.rsplit(".", 1)[-1], m)
    return root


def folded_by_hand(hf: nn.Module, model: nn.Module, layout: Layout) -> nn.Module:
    """The HF model with each megatron wrapper's s·B·A added to the HF weights it stands for."""
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    for name, m in model.named_modules():
        if not isinstance(m, MegatronLoRA):
            continue
        delta = m.scaling * m.lora_B.weight.detach() @ m.lora_A.weight.detach()  # megatron's [out, in]
        i = int(name.split(".")[2])
        h = f"model.layers.{i}."
        if name.endswith("linear_qkv"):
            for proj, part in zip("qkv", split_qkv(delta, layout), strict=True):
                sd[f"{h}self_attn.{proj}_proj.weight"] += part
        elif name.endswith("linear_proj"):
            sd[f"{h}self_attn.o_proj.weight"] += delta
        elif name.endswith("router"):
            sd[f"{h}mlp.gate.weight"] += delta
        elif ".local_experts." in name:
            x = int(name.split(".")[-2])
            sd[f"{h}mlp.experts.{'gate_up_proj' if name.endswith('fc1') else 'down_proj'}"][x] += delta
        elif name.endswith("linear_fc1"):
            gate, up = delta.chunk(2, dim=0)
            sd[f"{h}mlp.gate_proj.weight"] += gate
            sd[f"{h}mlp.up_proj.weight"] += up
        else:
            sd[f"{h}mlp.down_proj.weight"] += delta
    hf.load_state_dict(sd, strict=True)
    return hf


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    # layers 0 and 2 MoE, layer 1 dense; 2I = 48 != H = 64 (PEFT's [E, out, in] orientation matters)
    return make_tiny_moe(tmp_path_factory.mktemp("moe"), True, moe_intermediate_size=24)


@pytest.mark.parametrize("leaves", [
    {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "router"},
    {"router"},
], ids=["attention+mlp+experts+router", "router_only"])
def test_moe_adapter_exports_to_peft_and_loads_back(moe_dir, tmp_path, leaves):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(moe_dir)
    layout = layout_from_hf_config(cfg)
    assert layout.moe_layers == (0, 2)
    shapes = megatron_shapes(cfg, layout)
    model = stand_in(shapes, leaves, seed=1)
    spec = LoRASpec.model_validate({"rank": R, "alpha": ALPHA, "dropout": 0.1, "syncMode": "Adapter",
                                    "targetModules": sorted(leaves)})
    out = export.export_hf_peft(model, layout, spec, str(moe_dir), tmp_path)
    assert out is not None
    config = json.loads((out / "adapter_config.json").read_text())
    routers = ["model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"]
    if leaves == {"router"}:
        assert config["target_modules"] == [] and config["target_parameters"] == routers
    else:
        # never gate_proj / up_proj / down_proj / gate in target_modules: peft would move them onto the experts
        assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
        assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", routers[0],
                                               *(f"model.layers.1.mlp.{p}.weight" for p in
                                                 ("gate_proj", "up_proj", "down_proj")), routers[1]]
    assert config["lora_dropout"] == 0.0  # peft's ParamWrapper refuses dropout

    tensors = export.hf_adapter_tensors(model, layout)
    ids = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(2))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32), out).eval()
    sd = get_peft_model_state_dict(loaded)
    assert set(sd) == set(tensors) and all(torch.equal(sd[k], tensors[k]) for k in tensors)  # peft used every tensor
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
        want = folded_by_hand(tiny_moe_model(cfg), model, layout)(input_ids=ids).logits
        base = tiny_moe_model(cfg)(input_ids=ids).logits
    assert float((want - base).abs().max()) > 0.1  # the adapter (the router's alone, too) moves the logits
    assert float((got - want).abs().max()) < TOL

    other = stand_in(shapes, leaves, seed=7)
    export.load_hf_adapter(other, tensors, layout)
    again = export.hf_adapter_tensors(other, layout)
    assert set(again) == set(tensors) and all(torch.equal(again[k], tensors[k]) for k in tensors)
    with pytest.raises(KeyError, match="no megatron LoRA module"):
        export.load_hf_adapter(other, {**tensors, "base_model.model.x.lora_A.weight": torch.zeros(1)}, layout)


def test_router_mapping_and_dense_config_unchanged():
    layout = Layout(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, moe_layers=(0, 2))
    mods = adapter_modules(layout, ["router", "linear_fc2"])
    assert mods == {"decoder.layers.0.mlp.router": (("model.layers.0.mlp.gate",), REPL),
                    "decoder.layers.1.mlp.linear_fc2": (("model.layers.1.mlp.down_proj",), "row"),
                    "decoder.layers.2.mlp.router": (("model.layers.2.mlp.gate",), REPL)}
    assert adapter_modules(layout, ["router"], "sglang") == adapter_modules(layout, ["router"])
    dense = Layout(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    assert adapter_modules(dense, ["router"]) == {}
    names = list(adapter_modules(dense, ["linear_qkv", "linear_fc1"]))
    assert export.peft_targets(names) == (["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"], [])


class StandInRouter(nn.Module):
    """megatron's TopKRouter in miniature: a bare [E, H] weight, the logits from `gating`, which `forward` calls."""

    def __init__(self, experts: int, hidden: int, tp: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden))
        self.topk = 2
        if tp != 1:
            self.tp_group = type("Group", (), {"rank": lambda _: 0, "size": lambda _: tp})()

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None):
        return self.gating(x).softmax(-1), padding_mask


def test_router_lora_adds_to_the_gating_logits():
    from kora_trainer.backends.megatron.lora import LoRARouter, adapter_disabled, lora_modules

    torch.manual_seed(0)
    holder = nn.Module()
    router = StandInRouter(8, 16)
    holder.router = LoRARouter(router, R, ALPHA, 0.0, torch.randn(R, 16))
    wrapper = holder.router
    x = torch.randn(5, 3, 16)  # [s, b, H]
    base = nn.functional.linear(x, router.weight).softmax(-1)
    assert torch.equal(wrapper(x)[0], base)  # B = 0: the base router
    with torch.no_grad():
        wrapper.lora_B.weight.normal_()
    want = nn.functional.linear(x, router.weight) + ALPHA / R * (x @ wrapper.lora_A.weight.T) @ wrapper.lora_B.weight.T
    probs, mask = wrapper(x, "mask")
    assert mask == "mask" and torch.allclose(probs, want.softmax(-1), atol=1e-6)
    assert not torch.allclose(probs, base, atol=1e-3)
    with adapter_disabled(holder):
        assert torch.equal(wrapper(x)[0], base)
    assert list(lora_modules(holder)) == ["router"] and wrapper.topk == 2  # megatron's reads reach the router
    twin = copy.deepcopy(holder)  # the copy's router calls the copy's adapter
    with torch.no_grad():
        twin.router.lora_B.weight.zero_()
    assert torch.equal(twin.router(x)[0], base) and torch.allclose(wrapper(x)[0], want.softmax(-1), atol=1e-6)
    fold = router.weight + ALPHA / R * wrapper.lora_B.weight @ wrapper.lora_A.weight
    assert torch.allclose(wrapper.folded_weight(), fold)


def test_router_lora_refuses_tensor_parallelism_and_merge_mode():
    from kora_trainer.backends.megatron.lora import LoRARouter, apply_lora

    with pytest.raises(NotImplementedError, match="tensor parallel"):
        LoRARouter(StandInRouter(8, 16, tp=2), R, ALPHA, 0.0, torch.randn(R, 16))
    for mode in (None, "Merge", "EngineMerge"):
        lora = LoRASpec.model_validate({"rank": R, "targetModules": ["router"], "syncMode": mode})
        with pytest.raises(ValueError, match="SPEC rule 5"):
            apply_lora(nn.Module(), lora)
