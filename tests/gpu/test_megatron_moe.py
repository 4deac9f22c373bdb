"""Qwen3-MoE on the megatron backend (issue 7): a megatron-core GPTModel with the local spec and SequentialMLP
experts built from an HF Qwen3MoeConfig, HF weights loaded into it, logits equal to HF's Qwen3MoeForCausalLM.

Tiny random config: 3 layers (layer 1 dense via `mlp_only_layers`, layers 0 and 2 MoE), hidden 64, 4 heads /
2 KV heads, head_dim 16, 8 experts, top-2, moe_intermediate_size 32, dense intermediate_size 96, vocab 32;
norm_topk_prob on and off; megatron's alltoall and allgather token dispatchers; TP = 1, EP = 1. Expert LoRA
uses a variant with every layer MoE and moe_intermediate_size 24 (non-square experts) against HF + peft
`target_parameters`; the HF-PEFT export (attention + dense MLP + expert LoRA) and the router LoRA use the
3-layer variant (layer 1 dense) with moe_intermediate_size 24.
Tolerance (fp32, TF32 off): logits 1e-4 absolute, as for the dense model. bf16 is measured and reported only
(a near-tie in the router may pick another expert in bf16, so no bound is claimed).

The CPU tests (layer pattern, fused <-> per-expert tensors, router settings) run without a GPU; the rest need
a GPU and megatron-core:
    PYTHONPATH=trainer:engine:tests:/path/to/megatron-core pytest -m gpu tests/gpu/test_megatron_moe.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kora_trainer.backends.megatron import megatron_available
from kora_trainer.backends.megatron.convert import layout_from_hf_config, moe_layer_indices, param_maps
from tinymodel import make_tiny_moe, tiny_moe_config, tiny_moe_model

pytestmark = [pytest.mark.timeout(600)]
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not megatron_available(), reason="needs megatron-core (GPU-only; see docs/megatron_backend.md)"),
]
FP32_ATOL = 1e-4
REPORT = os.environ.get("KORA_MEGATRON_REPORT")  # a JSON-lines file the measured numbers are appended to


def on_gpu(f):
    for m in GPU_MARKS:
        f = m(f)
    return f


def report(**kw: object) -> None:
    print(json.dumps(kw))
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(kw) + "\n")


# ---- CPU: names, layouts, router settings ---------------------------------------------------------------

@pytest.mark.parametrize("step,dense", [(1, [1]), (2, []), (1, [])])
def test_moe_layer_pattern_is_hfs(step, dense):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = tiny_moe_config(num_hidden_layers=4, decoder_sparse_step=step, mlp_only_layers=dense)
    model = tiny_moe_model(cfg)
    want = tuple(i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock))
    assert moe_layer_indices(cfg) == want and want
    layout = layout_from_hf_config(cfg)
    assert layout.moe_layers == want and layout.num_experts == 8


def test_moe_names_cover_the_checkpoint_and_fused_experts_round_trip():
    from kora_trainer.hf_experts import fuse_hf_experts, unfuse_hf_experts

    cfg = tiny_moe_config()
    fused = tiny_moe_model(cfg).state_dict()
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)  # [E, 2I, H]
    per_expert = unfuse_hf_experts(fused)
    gate_up = fused["model.layers.2.mlp.experts.gate_up_proj"][5]
    assert torch.equal(per_expert["model.layers.2.mlp.experts.5.gate_proj.weight"], gate_up[:32])  # gate first
    assert torch.equal(per_expert["model.layers.2.mlp.experts.5.up_proj.weight"], gate_up[32:])
    back = fuse_hf_experts(per_expert)
    assert set(back) == set(fused) and all(torch.equal(back[k], fused[k]) for k in fused)
    layout = layout_from_hf_config(cfg)
    maps = param_maps(layout)
    assert sorted(n for pm in maps for n in pm.hf) == sorted(per_expert)
    names = {pm.megatron for pm in maps}
    assert "decoder.layers.0.mlp.router.weight" in names and "decoder.layers.1.mlp.linear_fc1.weight" in names
    assert "decoder.layers.2.mlp.experts.local_experts.7.linear_fc2.weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in names
    assert set(dict((pm.megatron, pm.hf) for pm in param_maps(layout, "sglang")).values()) == {pm.hf for pm in maps}


@pytest.mark.parametrize("norm", [True, False])
def test_moe_router_settings_match_hf(norm):
    from kora_trainer.backends.megatron.moe import moe_config_kwargs

    kw = moe_config_kwargs(tiny_moe_config(norm))
    # softmax over the top-k logits == HF's renormalised top-k of the full softmax; else softmax, then top-k
    assert kw["moe_router_pre_softmax"] is (not norm) and kw["moe_router_score_function"] == "softmax"
    assert kw["moe_router_topk"] == 2 and kw["num_moe_experts"] == 8 and kw["moe_ffn_hidden_size"] == 32
    assert kw["moe_layer_freq"] == [1, 0, 1] and kw["moe_expert_capacity_factor"] is None
    assert kw["moe_router_load_balancing_type"] == "none" and kw["moe_aux_loss_coeff"] == 0.0
    from transformers import Qwen3Config

    assert moe_config_kwargs(Qwen3Config(num_hidden_layers=2)) == {}  # dense configs are untouched


# ---- GPU ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    dirs = {norm: make_tiny_moe(tmp_path_factory.mktemp(f"moe_norm{int(norm)}"), norm) for norm in (True, False)}
    # every layer MoE, and 2I != H so the expert tensors are not square (PEFT's [E, out, in] orientation matters)
    dirs["i24"] = make_tiny_moe(tmp_path_factory.mktemp("moe_i24"), True, moe_intermediate_size=24, mlp_only_layers=[])
    dirs["dense1_i24"] = make_tiny_moe(tmp_path_factory.mktemp("moe_dense1_i24"), True, moe_intermediate_size=24)
    return dirs


def build(path: Path, dtype: torch.dtype, dispatcher: str = "alltoall", state=None):
    from transformers import AutoConfig

    from kora_trainer.backends.megatron.model import build_gpt_model, load_hf_state, read_hf_state

    cfg = AutoConfig.from_pretrained(path)
    layout = layout_from_hf_config(cfg)
    model = build_gpt_model(cfg, dtype, moe_dispatcher=dispatcher)
    load_hf_state(model, read_hf_state(path) if state is None else state, layout)
    return model.eval(), layout, cfg


def hf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


def ids_for(vocab: int, seed: int = 0, shape: tuple[int, int] = (3, 11)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g).cuda()


def mg_logits(model, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    return model(ids, pos, None).float()


def router_margin(hf_model, ids: torch.Tensor, k: int) -> float:
    """Smallest gap between a token's k-th and (k+1)-th router probability in HF (a tie would make the
    choice of experts, and so the comparison, ill-posed)."""
    try:
        logits = getattr(hf_model(input_ids=ids, output_router_logits=True), "router_logits", None)
    except Exception:  # a measurement only: never fail the logit comparison on it
        logits = None
    if not logits:
        return float("nan")
    gaps = []
    for lg in logits:
        p = torch.softmax(lg.float(), -1).sort(-1, descending=True).values
        gaps.append(float((p[:, k - 1] - p[:, k]).min()))
    return min(gaps)


def randomise_adapter(model, seed: int, std: float = 0.2) -> None:
    """Every LoRA factor of a megatron model ~ N(0, std), so each adapter moves the logits."""
    from kora_trainer.backends.megatron.lora import adapter_parameters

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * std)


@on_gpu
@pytest.mark.usefixtures("parallel")
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "no_norm"])
def test_moe_logits_equal_hf_fp32(moe_dirs, norm, dispatcher):
    path = moe_dirs[norm]
    model, layout, cfg = build(path, torch.float32, dispatcher)
    assert layout.moe_layers == (0, 2) and cfg.norm_topk_prob is norm
    kinds = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    assert kinds == ["MoELayer", "MLP", "MoELayer"], kinds
    assert type(model.decoder.layers[0].mlp.experts).__name__ == "SequentialMLP"
    ref = hf(path, torch.float32)
    ids = ids_for(cfg.vocab_size)
    with torch.no_grad():
        got, want = mg_logits(model, ids), ref(input_ids=ids).logits.float()
        margin = router_margin(ref, ids, cfg.num_experts_per_tok)
    err = float((got - want).abs().max())
    on_disk = "fused" if any(k.endswith("experts.gate_up_proj") for k in _disk_keys(path)) else "per_expert"
    report(test="moe_logits_fp32", norm_topk_prob=norm, dispatcher=dispatcher, max_abs=err,
           logit_scale=float(want.abs().max()), router_min_topk_gap=margin, checkpoint_experts=on_disk)
    assert err < FP32_ATOL


def _disk_keys(path: Path) -> list[str]:
    from kora_trainer.backends.megatron.model import read_hf_state

    return list(read_hf_state(path))


@on_gpu
@pytest.mark.usefixtures("parallel")
def test_moe_fused_state_loads_the_same_and_exports_to_hf_names(moe_dirs):
    """The transformers-5 in-memory (fused) state loads to the same megatron model as the checkpoint, and the
    base exported under HF names is the per-expert checkpoint bit for bit; fused back, a plain HF model loads it
    strictly and gives the same logits."""
    from kora_trainer.backends.megatron.model import hf_state, read_hf_state
    from kora_trainer.hf_experts import fuse_hf_experts, unfuse_hf_experts

    path = moe_dirs[True]
    ref = hf(path, torch.float32)
    from_disk, layout, cfg = build(path, torch.float32)
    from_memory, _, _ = build(path, torch.float32, state={k: v.cpu() for k, v in ref.state_dict().items()})
    a, b = dict(from_disk.named_parameters()), dict(from_memory.named_parameters())
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    want = unfuse_hf_experts(read_hf_state(path))
    got = dict(hf_state(from_disk, layout))
    assert set(got) == set(want) and all(torch.equal(got[k].cpu(), want[k]) for k in want)
    plain = tiny_moe_model(cfg).to("cuda")
    plain.load_state_dict(fuse_hf_experts(got), strict=True)
    ids = ids_for(cfg.vocab_size, seed=1)
    with torch.no_grad():
        err = float((plain(input_ids=ids).logits.float() - mg_logits(from_disk, ids)).abs().max())
    report(test="moe_export_fp32", reloaded_hf_max_abs=err)
    assert err < FP32_ATOL


@on_gpu
@pytest.mark.usefixtures("parallel")
def test_moe_attention_lora_equals_peft(moe_dirs):
    """LoRA on the attention linears of the MoE model (experts and router stay frozen, not wrapped)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from test_megatron_model import megatron_model, spec

    from kora_trainer.backends.megatron.convert import PEFT_PREFIX, adapter_modules
    from kora_trainer.backends.megatron.export import hf_adapter_tensors, load_hf_adapter
    from kora_trainer.backends.megatron.lora import lora_modules

    path, targets, r = moe_dirs[True], ["linear_qkv", "linear_proj"], 4
    model, layout, cfg = megatron_model(path, torch.float32, spec(targets, rank=r))
    assert sorted(lora_modules(model)) == sorted(adapter_modules(layout, targets))
    g = torch.Generator().manual_seed(1)
    adapter: dict[str, torch.Tensor] = {}
    for hf_modules, _ in adapter_modules(layout, targets).values():
        a = torch.randn(r, 64, generator=g) * 0.2  # in: hidden (q/k/v) or heads·head_dim (o), both 64 here
        for m in hf_modules:
            out = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64}[m.rsplit(".", 1)[-1]]
            adapter[f"{PEFT_PREFIX}{m}.lora_A.weight"] = a.clone()
            adapter[f"{PEFT_PREFIX}{m}.lora_B.weight"] = torch.randn(out, r, generator=g) * 0.2
    load_hf_adapter(model, adapter, layout)
    peft = get_peft_model(hf(path, torch.float32), LoraConfig(r=r, lora_alpha=8.0,
                                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    res = set_peft_model_state_dict(peft, {k: v.cuda() for k, v in adapter.items()})
    assert not res.unexpected_keys
    ids = ids_for(cfg.vocab_size, seed=2)
    with torch.no_grad():
        got, want = mg_logits(model, ids), peft.eval()(input_ids=ids).logits.float()
        base = hf(path, torch.float32)(input_ids=ids).logits.float()
    err, shift = float((got - want).abs().max()), float((want - base).abs().max())
    exported = hf_adapter_tensors(model, layout)
    report(test="moe_attention_lora_vs_peft_fp32", max_abs=err, adapter_effect=shift)
    assert shift > 0.1 and err < FP32_ATOL
    assert set(exported) == set(adapter) and all(torch.equal(exported[k].cpu(), adapter[k]) for k in adapter)


@on_gpu
@pytest.mark.usefixtures("parallel")
def test_moe_logits_bf16_measured(moe_dirs):
    """bf16: measured and reported (megatron-bf16 and HF-bf16 against HF-fp32), no bound asserted beyond
    finiteness — one near-tie in the router can legitimately pick another expert in bf16."""
    path = moe_dirs[True]
    model, _, cfg = build(path, torch.bfloat16)
    ids = ids_for(cfg.vocab_size)
    with torch.no_grad():
        ref = hf(path, torch.float32)(input_ids=ids).logits.float()
        hf16 = hf(path, torch.bfloat16)(input_ids=ids).logits.float()
        got = mg_logits(model, ids)
    report(test="moe_logits_bf16", megatron_vs_fp32=float((got - ref).abs().max()),
           hf_bf16_vs_fp32=float((hf16 - ref).abs().max()), megatron_vs_hf_bf16=float((got - hf16).abs().max()),
           logit_scale=float(ref.abs().max()))
    assert torch.isfinite(got).all()


@on_gpu
@pytest.mark.usefixtures("parallel")
def test_moe_expert_lora_equals_peft_target_parameters(moe_dirs):
    """LoRA on every expert's linear_fc1 / linear_fc2 (and linear_qkv): logits equal HF + PEFT with
    `target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]` holding the exported grouped
    factors; the export's names are PEFT's own; it loads back exactly; Merge mode's HF state gives the same.
    (PEFT's target_modules must not name gate_proj / up_proj here: on transformers 5 peft maps those onto the
    fused gate_up_proj with rank 2r.)"""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from test_megatron_model import megatron_model, spec

    from kora_trainer.backends.megatron.export import hf_adapter_tensors, load_hf_adapter
    from kora_trainer.backends.megatron.lora import lora_modules
    from kora_trainer.backends.megatron.model import hf_state
    from kora_trainer.backends.megatron.moe import expert_target_parameters
    from kora_trainer.hf_experts import fuse_hf_experts

    path, r, alpha = moe_dirs["i24"], 4, 8.0
    lora = spec(["linear_qkv", "linear_fc1", "linear_fc2"], rank=r, alpha=alpha)
    model, layout, cfg = megatron_model(path, torch.float32, lora)
    mods = lora_modules(model)
    assert layout.moe_layers == (0, 1, 2)
    assert len(mods) == 3 + 3 * 2 * cfg.num_experts  # linear_qkv per layer + 3 MoE layers x E x (fc1, fc2)
    randomise_adapter(model, seed=3)
    tensors = hf_adapter_tensors(model, layout)
    targets = expert_target_parameters(mods)
    assert targets == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    expert_a = [t for k, t in tensors.items() if ".mlp.experts." in k and k.endswith("lora_A.weight")]
    assert len(expert_a) == 6 and all(t.shape[0] == cfg.num_experts * r for t in expert_a)

    # the reference: HF + peft ParamWrapper; factors set by walking peft's modules (independent of key names)
    peft = get_peft_model(hf(path, torch.float32), LoraConfig(
        r=r, lora_alpha=alpha, target_modules=["q_proj", "k_proj", "v_proj"], target_parameters=targets))
    grouped = {}
    for name, m in peft.named_modules():
        if type(m).__name__ == "ParamWrapper":
            layer = int(name.split(".layers.")[1].split(".")[0])
            grouped[(layer, m.parameter_name)] = m
    assert sorted(grouped) == [(i, p) for i in layout.moe_layers for p in ("down_proj", "gate_up_proj")]
    with torch.no_grad():
        # megatron's per-expert factors, regrouped here independently of moe.py
        for (layer, param), pm in grouped.items():
            leaf = "linear_fc1" if param == "gate_up_proj" else "linear_fc2"
            ms = [mods[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{leaf}"] for e in range(cfg.num_experts)]
            pm.lora_A["default"].weight.copy_(torch.cat([m.lora_A.weight for m in ms], 0))
            b = torch.zeros_like(pm.lora_B["default"].weight)  # [out, r·E]
            for e, m in enumerate(ms):
                for j in range(r):
                    b[:, j * cfg.num_experts + e] = m.lora_B.weight[:, j]
            pm.lora_B["default"].weight.copy_(b)
        for name, m in peft.named_modules():  # q / k / v (copies of megatron's one fused-QKV A)
            if name.endswith(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")) and hasattr(m, "lora_A"):
                key = name.removeprefix("base_model.model.")
                m.lora_A["default"].weight.copy_(tensors[f"base_model.model.{key}.lora_A.weight"])
                m.lora_B["default"].weight.copy_(tensors[f"base_model.model.{key}.lora_B.weight"])
    ids = ids_for(cfg.vocab_size, seed=4)
    with torch.no_grad():
        got, want = mg_logits(model, ids), peft.eval()(input_ids=ids).logits.float()
        base = hf(path, torch.float32)(input_ids=ids).logits.float()
    err, shift = float((got - want).abs().max()), float((want - base).abs().max())
    peft_keys = set(get_peft_model_state_dict(peft))
    report(test="moe_expert_lora_vs_peft_fp32", max_abs=err, adapter_effect=shift,
           names_equal_peft=peft_keys == set(tensors), only_ours=sorted(set(tensors) - peft_keys)[:4],
           only_peft=sorted(peft_keys - set(tensors))[:4])
    assert shift > 0.1 and err < FP32_ATOL
    # exported tensors == peft's state dict (names and values)
    sd = get_peft_model_state_dict(peft)
    assert peft_keys == set(tensors)
    assert all(torch.equal(sd[k].cpu(), tensors[k].cpu()) for k in tensors)
    # back into a megatron model built with another seed: the same tensors
    other, _, _ = megatron_model(path, torch.float32, lora, seed=7)
    load_hf_adapter(other, tensors, layout)
    again = hf_adapter_tensors(other, layout)
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)
    # Merge mode: per-expert folds, fused into a plain HF model
    plain = tiny_moe_model(cfg).to("cuda")
    plain.load_state_dict(fuse_hf_experts(dict(hf_state(model, layout, merged=True))), strict=True)
    with torch.no_grad():
        merged_err = float((plain(input_ids=ids).logits.float() - got).abs().max())
    report(test="moe_expert_lora_merged_fp32", max_abs=merged_err)
    assert merged_err < FP32_ATOL


@on_gpu
@pytest.mark.usefixtures("parallel")
def test_moe_adapter_exports_to_a_peft_dir_that_loads(moe_dirs, tmp_path):
    """Attention + MLP LoRA on the MoE model (layer 1 dense: its linear_fc1 / linear_fc2 are plain linears, the
    MoE layers' are every expert's): `export_hf_peft` writes a directory `PeftModel.from_pretrained` loads on
    HF's Qwen3MoeForCausalLM with megatron's logits; the adapter loads back into another megatron model bit for
    bit."""
    from peft import PeftModel
    from test_megatron_model import TARGETS, megatron_model, spec

    from kora_trainer.backends.megatron.export import export_hf_peft, hf_adapter_tensors, load_hf_adapter

    path = moe_dirs["dense1_i24"]
    lora = spec(TARGETS)
    model, layout, cfg = megatron_model(path, torch.float32, lora)
    assert layout.moe_layers == (0, 2)
    randomise_adapter(model, seed=5)
    out = export_hf_peft(model, layout, lora, str(path), tmp_path, meta={"step": 0})
    assert out is not None
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["target_parameters"][:2] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    loaded = PeftModel.from_pretrained(hf(path, torch.float32), out).eval()
    ids = ids_for(cfg.vocab_size, seed=6)
    with torch.no_grad():
        got, want = mg_logits(model, ids), loaded(input_ids=ids).logits.float()
        base = hf(path, torch.float32)(input_ids=ids).logits.float()
    err, shift = float((got - want).abs().max()), float((want - base).abs().max())
    report(test="moe_lora_peft_dir_fp32", max_abs=err, adapter_effect=shift, logit_scale=float(want.abs().max()))
    assert shift > 0.1 and err < FP32_ATOL
    exported = hf_adapter_tensors(model, layout)
    other, _, _ = megatron_model(path, torch.float32, lora, seed=7)
    load_hf_adapter(other, exported, layout)
    again = hf_adapter_tensors(other, layout)
    assert set(again) == set(exported) and all(torch.equal(again[k], exported[k]) for k in exported)


@on_gpu
@pytest.mark.usefixtures("parallel")
def test_moe_router_lora_equals_peft(moe_dirs, tmp_path):
    """Router LoRA (Adapter mode): B = 0 leaves the policy unchanged; a random adapter moves the logits and
    megatron equals HF + peft loading the exported directory (`target_parameters` on `mlp.gate.weight`); with the
    adapter switched off megatron gives the base HF logits; the router factors get gradients."""
    from peft import PeftModel
    from test_megatron_model import megatron_model, spec

    from kora_trainer.backends.megatron.export import export_hf_peft
    from kora_trainer.backends.megatron.lora import LoRARouter, adapter_disabled, lora_modules
    from kora_trainer.config import SyncMode

    path = moe_dirs["dense1_i24"]
    lora = spec(["router"]).model_copy(update={"sync_mode": SyncMode.ADAPTER})
    model, layout, cfg = megatron_model(path, torch.float32, lora)
    mods = lora_modules(model)
    assert sorted(mods) == ["decoder.layers.0.mlp.router", "decoder.layers.2.mlp.router"]
    assert all(isinstance(m, LoRARouter) and m.lora_B.weight.shape == (cfg.num_experts, m.rank) for m in mods.values())
    ids = ids_for(cfg.vocab_size, seed=8)
    with torch.no_grad():
        start = mg_logits(model, ids)
        with adapter_disabled(model):
            off = mg_logits(model, ids)
    assert torch.equal(start, off)  # B = 0
    randomise_adapter(model, seed=9)
    out = export_hf_peft(model, layout, lora, str(path), tmp_path)
    assert out is not None
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == [] and config["target_parameters"] == [
        "model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"]
    loaded = PeftModel.from_pretrained(hf(path, torch.float32), out).eval()
    with torch.no_grad():
        got, want = mg_logits(model, ids), loaded(input_ids=ids).logits.float()
        with adapter_disabled(model):
            off = mg_logits(model, ids)
        base_ref = hf(path, torch.float32)
        base = base_ref(input_ids=ids).logits.float()
        margin = router_margin(base_ref, ids, cfg.num_experts_per_tok)
    err, base_err = float((got - want).abs().max()), float((off - base).abs().max())
    shift = float((got - off).abs().max())
    report(test="moe_router_lora_vs_peft_fp32", max_abs=err, adapter_off_max_abs=base_err, adapter_effect=shift,
           base_router_min_topk_gap=margin)
    assert shift > 0.1 and err < FP32_ATOL and base_err < FP32_ATOL
    model.zero_grad(set_to_none=True)
    mg_logits(model, ids).square().mean().backward()
    grads = [float(p.grad.abs().max()) for m in mods.values() for p in (m.lora_A.weight, m.lora_B.weight)]
    assert all(g > 0 for g in grads), grads
