"""`kora merge`: fold a PEFT adapter into a sharded checkpoint; logits match peft's; errors are hard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

TOL = 1e-5  # fp32 end to end: the fold is one fp32 addmm, rounded once


def kora(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("kora")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)


def _randomise_lora(model: torch.nn.Module) -> None:
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    base = Qwen3ForCausalLM(cfg).float()
    base.save_pretrained(root / "base", max_shard_size="100KB")  # several shards
    (root / "base" / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    _randomise_lora(peft_model)
    peft_model.save_pretrained(root / "adapter")
    return root


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_merged_checkpoint_gives_peft_logits(dense, tmp_path):
    out = tmp_path / "merged"
    res = kora("merge", "--base", str(dense / "base"), "--adapter", str(dense / "adapter"), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "merged 14 adapter pairs" in res.stdout
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    base = AutoModelForCausalLM.from_pretrained(dense / "base", dtype=torch.float32)
    reference = _logits(PeftModel.from_pretrained(base, dense / "adapter"), ids)
    merged = _logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), ids)
    plain = _logits(AutoModelForCausalLM.from_pretrained(dense / "base", dtype=torch.float32), ids)
    assert (reference - plain).abs().max() > 1e-2  # the adapter really changes the model
    assert (merged - reference).abs().max() < TOL
    # layout kept: same shards, same index, auxiliary files copied byte for byte
    shards = sorted(p.name for p in (dense / "base").glob("*.safetensors"))
    assert len(shards) > 1 and sorted(p.name for p in out.glob("*.safetensors")) == shards
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (dense / "base" / name).read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((dense / "base/model.safetensors.index.json").read_text())["weight_map"]


def test_unpaired_adapter_tensor_is_a_hard_error(dense, tmp_path):
    bad = tmp_path / "bad-adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((dense / "adapter/adapter_config.json").read_text())
    tensors = load_file(str(dense / "adapter/adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key.replace("q_proj", "qq_proj")] = tensors[key].clone()
    tensors[key.replace("q_proj", "qq_proj").replace("lora_A", "lora_B")] = torch.zeros(64, 4)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    out = tmp_path / "never"
    res = kora("merge", "--base", str(dense / "base"), "--adapter", str(bad), "--out", str(out))
    assert res.returncode == 1
    assert "model.layers.0.self_attn.qq_proj.lora_A.weight has no base partner" in res.stderr
    assert not out.exists() and not list(tmp_path.glob(".never.partial-*"))


def test_lone_lora_a_is_named(dense, tmp_path):
    bad = tmp_path / "lone"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((dense / "adapter/adapter_config.json").read_text())
    tensors = load_file(str(dense / "adapter/adapter_model.safetensors"))
    del tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    res = kora("merge", "--base", str(dense / "base"), "--adapter", str(bad), "--out", str(tmp_path / "o"))
    assert res.returncode == 1 and "layers.1.mlp.down_proj.lora_A.weight has no lora_B partner" in res.stderr


def test_refuses_to_overwrite_inputs_or_a_full_directory(dense, tmp_path):
    res = kora(
        "merge", "--base", str(dense / "base"), "--adapter", str(dense / "adapter"), "--out", str(dense / "base")
    )
    assert res.returncode == 1 and "never overwrite inputs" in res.stderr
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    res = kora("merge", "--base", str(dense / "base"), "--adapter", str(dense / "adapter"), "--out", str(full))
    assert res.returncode == 1 and "not empty" in res.stderr and (full / "keep.txt").read_text() == "mine"


def test_grouped_experts_3d(tmp_path):
    """A checkpoint that stores experts as 3-D [E, out, in] tensors (written here with safetensors, since
    transformers 5 saves Qwen3-MoE per expert); the adapter is peft's own target_parameters format."""
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(cfg).float()
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 16, 16)
    half = len(state) // 2
    names = sorted(state)
    save_file({k: state[k] for k in names[:half]}, str(base_dir / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[half:]}, str(base_dir / "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, k in enumerate(names)}
    (base_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg.save_pretrained(base_dir)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=2,
            lora_alpha=4,
            target_modules=["q_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    _randomise_lora(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    res = kora("merge", "--base", str(base_dir), "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "m"))
    assert res.returncode == 0, res.stderr
    assert "merged 6 adapter pairs" in res.stdout  # per layer: q_proj, gate_up_proj, down_proj
    reference = peft_model.merge_and_unload().state_dict()
    merged = {}
    for shard in (tmp_path / "m").glob("*.safetensors"):
        merged.update(load_file(str(shard)))
    for layer in (0, 1):
        for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.q_proj.weight"):
            key = f"model.layers.{layer}.{name}"
            assert (merged[key] - state[key]).abs().max() > 1e-3, key  # it moved
            assert (merged[key] - reference[key]).abs().max() < TOL, key


def test_bf16_rounding_matches_torch():
    from kora_trainer.checkpoint.peft_adapter import from_float32, to_float32

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(10000, generator=g) * 10 ** torch.randint(-8, 8, (10000,), generator=g),
                   torch.tensor([0.0, -0.0, 1.0, 65504.0, 3.4e38, float("inf"), -float("inf"), 1e-40])])
    want = x.to(torch.bfloat16).view(torch.int16).numpy().view("uint16")
    got = from_float32(x.numpy(), "BF16")
    assert (got == want).all()
    assert (to_float32(got, "BF16") == x.to(torch.bfloat16).float().numpy()).all()


def test_merge_does_not_import_torch():
    """torch alone is ~700 MB of RSS: the merge path must stay numpy-only to keep its memory bound."""
    code = "import sys, kora_trainer.checkpoint.merge, kora_trainer.checkpoint.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_fused_expert_adapter_into_a_per_expert_checkpoint(tmp_path):
    """transformers 5 trains Qwen3-MoE with fused `experts.gate_up_proj` [E, 2I, H] but saves experts one by one
    (`experts.{e}.gate_proj.weight`, ...): the PEFT adapter's target_parameters must land on those."""
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=4,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=3,
                         num_experts_per_tok=2, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    model.save_pretrained(tmp_path / "base")  # transformers' own per-expert layout
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                  target_parameters=["mlp.experts.gate_up_proj",
                                                                     "mlp.experts.down_proj"]))
    _randomise_lora(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    res = kora("merge", "--base", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"),
               "--out", str(tmp_path / "m"))
    assert res.returncode == 0, res.stderr
    # per layer: q_proj + 3 experts x (gate, up, down)
    assert "merged 20 adapter pairs" in res.stdout
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    expected = _logits(peft_model.eval(), ids)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval(), ids)
    assert (expected - base_logits).abs().max() > 1e-3  # the adapter matters
    assert (_logits(merged, ids) - expected).abs().max() < TOL
