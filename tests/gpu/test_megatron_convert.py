"""The megatron backend's HF <-> megatron layouts (pure torch, no megatron-core, no GPU: runs everywhere).

The GPU tests beside this one prove the layouts against real megatron modules; these pin the layout rules
themselves (fused QKV per KV group, [gate_t; up_t] per TP rank, shared A of fused LoRA) on the CPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kora_trainer.backends.megatron.convert import (
    COLUMN,
    FC1,
    PEFT_PREFIX,
    QKV,
    ROW,
    Layout,
    adapter_from_hf,
    adapter_modules,
    adapter_to_hf,
    from_megatron_shards,
    fuse_qkv,
    param_maps,
    split_qkv,
    to_megatron_shard,
)

LAYOUT = Layout(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=3)


def test_every_backend_module_imports_without_megatron():
    for mod in ("convert", "parallel", "model", "lora", "export", "backend"):
        importlib.import_module(f"kora_trainer.backends.megatron.{mod}")


def test_qkv_interleaves_query_groups():
    d, hidden = LAYOUT.head_dim, 5
    q = torch.arange(4 * d).repeat_interleave(hidden).view(4 * d, hidden).float()  # row r of q holds r
    k = 100 + torch.arange(2 * d).repeat_interleave(hidden).view(2 * d, hidden).float()
    v = 200 + torch.arange(2 * d).repeat_interleave(hidden).view(2 * d, hidden).float()
    fused = fuse_qkv(q, k, v, LAYOUT)
    # group 0: q heads 0,1 (rows 0..5), k head 0 (rows 0..2), v head 0; then group 1
    want = [*range(0, 6), 100, 101, 102, 200, 201, 202, *range(6, 12), 103, 104, 105, 203, 204, 205]
    assert fused[:, 0].tolist() == [float(x) for x in want]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, LAYOUT), (q, k, v), strict=True))
    # bias (1-D) takes the same path
    assert torch.equal(split_qkv(fuse_qkv(q[:, 0], k[:, 0], v[:, 0], LAYOUT), LAYOUT)[2], v[:, 0])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", [QKV, FC1, COLUMN, ROW])
def test_shards_round_trip(kind, tp):
    g = torch.Generator().manual_seed(0)
    shapes = {QKV: [(12, 8), (6, 8), (6, 8)], FC1: [(10, 8), (10, 8)], COLUMN: [(16, 8)], ROW: [(8, 12)]}[kind]
    hf = [torch.randn(*s, generator=g) for s in shapes]
    shards = [to_megatron_shard(kind, hf, LAYOUT, r, tp) for r in range(tp)]
    back = from_megatron_shards(kind, shards, LAYOUT)
    assert all(torch.equal(a, b) for a, b in zip(back, hf, strict=True))
    if kind == FC1 and tp == 2:  # each rank stacks its own halves: [gate_t; up_t]
        assert torch.equal(shards[1], torch.cat([hf[0][5:], hf[1][5:]]))


def test_indivisible_shapes_are_refused():
    with pytest.raises(ValueError, match="KV heads"):
        to_megatron_shard(QKV, [torch.zeros(12, 8), torch.zeros(6, 8), torch.zeros(6, 8)], LAYOUT, 0, 4)
    with pytest.raises(ValueError, match="tensor parallel size 3"):
        to_megatron_shard(ROW, [torch.zeros(8, 8)], LAYOUT, 0, 3)


def test_names_cover_the_model_and_follow_the_flavour():
    maps = param_maps(LAYOUT)
    hf = [n for pm in maps for n in pm.hf]
    assert len(hf) == len(set(hf)) and "lm_head.weight" in hf and "model.layers.1.mlp.up_proj.weight" in hf
    assert "lm_head.weight" not in [n for pm in param_maps(Layout(2, 4, 2, 3, tied=True)) for n in pm.hf]
    assert [n for pm in param_maps(LAYOUT, "sglang") for n in pm.hf] == hf  # dense Qwen3: SGLang reads HF names
    mods = adapter_modules(LAYOUT, ["linear_qkv", "linear_fc2"])
    assert mods["decoder.layers.0.self_attention.linear_qkv"] == (
        tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv"), QKV)
    assert mods["decoder.layers.1.mlp.linear_fc2"] == (("model.layers.1.mlp.down_proj",), ROW)


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_adapter_shares_a_and_round_trips(tp):
    g = torch.Generator().manual_seed(1)
    mods = ("m.q_proj", "m.k_proj", "m.v_proj")
    a = torch.randn(2, 8, generator=g)
    b_hf = [torch.randn(12, 2, generator=g), torch.randn(6, 2, generator=g), torch.randn(6, 2, generator=g)]
    tensors = {f"{PEFT_PREFIX}{m}.lora_A.weight": a.clone() for m in mods}
    tensors |= {f"{PEFT_PREFIX}{m}.lora_B.weight": b for m, b in zip(mods, b_hf, strict=True)}
    pieces = [adapter_from_hf(mods, QKV, tensors, LAYOUT, r, tp) for r in range(tp)]
    assert all(torch.equal(p[0], a) for p in pieces)  # A replicated on every rank
    out = adapter_to_hf(mods, QKV, [p[0] for p in pieces], [p[1] for p in pieces], LAYOUT)
    assert set(out) == set(tensors) and all(torch.equal(out[k], tensors[k]) for k in tensors)
    assert len({out[f"{PEFT_PREFIX}{m}.lora_A.weight"].data_ptr() for m in mods}) == 3  # safetensors-safe
    # the fused delta B·A is exactly the q/k/v deltas stacked in megatron's layout
    fused_b = torch.cat([p[1] for p in pieces])
    assert torch.allclose(fused_b @ a, fuse_qkv(*(b @ a for b in b_hf), LAYOUT))
    tensors[f"{PEFT_PREFIX}m.k_proj.lora_A.weight"] = a + 1
    with pytest.raises(ValueError, match="shares one A"):
        adapter_from_hf(mods, QKV, tensors, LAYOUT)


def test_row_adapter_shards_a_and_keeps_b():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 12, generator=g), torch.randn(8, 2, generator=g)
    tensors = {f"{PEFT_PREFIX}m.o_proj.lora_A.weight": a, f"{PEFT_PREFIX}m.o_proj.lora_B.weight": b}
    pieces = [adapter_from_hf(("m.o_proj",), ROW, tensors, LAYOUT, r, 2) for r in range(2)]
    assert pieces[0][0].shape == (2, 6) and all(torch.equal(p[1], b) for p in pieces)
    out = adapter_to_hf(("m.o_proj",), ROW, [p[0] for p in pieces], [p[1] for p in pieces], LAYOUT)
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)
