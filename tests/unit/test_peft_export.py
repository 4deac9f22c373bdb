"""The exported lora_adapter/ loads with peft.PeftModel.from_pretrained and gives the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from kora_trainer.checkpoint.peft_export import adapter_config, export_peft


def test_export_round_trips_through_peft(tmp_path: Path):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    trained = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]))
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    want = trained(ids).logits.detach()
    # peft's in-memory names carry the adapter name (".default"); the saved format drops it
    tensors = get_peft_model_state_dict(trained)
    config = adapter_config(base_model=str(tmp_path / "base"), rank=4, alpha=8, target_modules=["q_proj", "o_proj"])
    out = export_peft(tmp_path / "ckpt", tensors, config, {"step": 7, "sync_mode": "Adapter"})
    assert out == tmp_path / "ckpt" / "lora_adapter"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    got = PeftModel.from_pretrained(fresh, out)(ids).logits.detach()
    assert (got - want).abs().max() < 1e-6
    # a second export replaces the first whole
    export_peft(tmp_path / "ckpt", tensors, config, {"step": 8})
    assert json.loads((out / "kora_lora_meta.json").read_text())["step"] == 8
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["lora_adapter"]
