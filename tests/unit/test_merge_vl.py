"""`kora merge` of a vision-language adapter (issue 20): the merged directory is still the VL checkpoint —
`vision_config` and the architecture kept, the tower's weights in it (folded where the adapter had vision targets) —
and `Qwen3_5ForConditionalGeneration` loads it with no missing or unexpected keys and gives peft's logits on an
image prompt.

The adapter is made by the trainer's own export path (`apply_lora` with the scope, then `adapter_tensors` +
`peft_config_dict` into `export_peft`, what `TorchBackend.peft_export` / `checkpoint.training.export_adapter` call),
its lora_B drawn at random so every pair moves the model. The base is the VL toy (`kora make-toy --vl`) re-saved in
several shards, as a real VL checkpoint is, so the tower's tensors sit in shards of their own and the index is
rewritten around them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

from kora_trainer.checkpoint.peft_export import export_peft
from kora_trainer.config import LoRASpec
from kora_trainer.lora import apply_lora
from kora_trainer.lora.model import adapter_tensors, peft_config_dict
from kora_trainer.toys.vl import PROMPT, image_png
from kora_trainer.wire.vision import VisionTokens, images_from_bytes, load_image_processor, prompt_ids

pytestmark = pytest.mark.timeout(240)
TOL = 1e-5  # fp32 end to end: each fold is one fp32 W + s·B·A, rounded once (measured 1.8e-6 on logits of ~4)
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
TOWER = {"model.visual.blocks.0.attn.qkv.weight", "model.visual.blocks.0.attn.proj.weight",
         "model.visual.blocks.0.mlp.linear_fc1.weight", "model.visual.blocks.0.mlp.linear_fc2.weight",
         "model.visual.merger.linear_fc1.weight", "model.visual.merger.linear_fc2.weight"}


def kora(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("kora")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=200)


@pytest.fixture(scope="module")
def sharded_base(vl_toy_dir, tmp_path_factory) -> Path:
    """The toy's files (tokenizer, image processor, chat template) with its weights in several shards."""
    base = tmp_path_factory.mktemp("vl_merge") / "base"
    shutil.copytree(vl_toy_dir, base, ignore=shutil.ignore_patterns("images", "train.*", "model.safetensors"))
    Qwen3_5ForConditionalGeneration.from_pretrained(vl_toy_dir, dtype=torch.float32).save_pretrained(
        base, max_shard_size="100KB")
    assert len(list(base.glob("*.safetensors"))) > 2
    return base


def export(base: Path, root: Path, scope: str) -> Path:
    model = Qwen3_5ForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    spec = LoRASpec(rank=4, alpha=8, target_modules=TARGETS, scope=scope)
    apply_lora(model, spec)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)  # a trained-looking adapter: B = 0 would fold to the base
    return export_peft(root, dict(adapter_tensors(model)), peft_config_dict(model, spec, str(base)), {"scope": scope})


def image_logits(model: torch.nn.Module, base: Path) -> torch.Tensor:
    """Logits [2, T, V] of two image prompts (red, magenta) through the model's own HF forward."""
    tokens = VisionTokens.of(model.config)
    tokenizer, processor = AutoTokenizer.from_pretrained(base), load_image_processor(str(base))
    per_prompt = [images_from_bytes(processor, [image_png(colour, 3)]) for colour in (0, 5)]
    ids = torch.tensor([prompt_ids(tokenizer, tokens, PROMPT, im) for im in per_prompt])  # [2, T]
    both = images_from_bytes(processor, [image_png(colour, 3) for colour in (0, 5)])
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=both.pixel_values,
                     image_grid_thw=both.image_grid_thw, mm_token_type_ids=(ids == tokens.image).long()).logits


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for shard in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}


@pytest.mark.parametrize("scope", ["all", "language"])
def test_a_merged_vl_adapter_loads_as_the_vl_class_and_gives_peft_logits(sharded_base, tmp_path, scope):
    adapter = export(sharded_base, tmp_path, scope)
    out = tmp_path / "merged"
    res = kora("merge", "--base", str(sharded_base), "--adapter", str(adapter), "--out", str(out))
    assert res.returncode == 0, res.stderr
    pairs = 16 if scope == "all" else 10  # the tower's 6 (attn qkv/proj, MLP fc1/fc2, merger fc1/fc2) or none
    assert f"merged {pairs} adapter pairs" in res.stdout

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["vision_config"] == json.loads((sharded_base / "config.json").read_text())["vision_config"]
    merged, info = Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32,
                                                                   output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())

    before, after = weights(sharded_base), weights(out)
    assert set(after) == set(before) and set(after) >= TOWER  # the tower is in the merged checkpoint
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed & TOWER == (TOWER if scope == "all" else set())

    reference = image_logits(PeftModel.from_pretrained(
        Qwen3_5ForConditionalGeneration.from_pretrained(sharded_base, dtype=torch.float32), str(adapter)),
        sharded_base)
    plain = image_logits(Qwen3_5ForConditionalGeneration.from_pretrained(sharded_base, dtype=torch.float32),
                         sharded_base)
    assert (reference - plain).abs().max() > 1e-1  # the adapter really moves the policy
    assert (image_logits(merged, sharded_base) - reference).abs().max() < TOL
    if scope == "all":  # the check would catch a merge that dropped the tower's adapters
        with torch.no_grad():
            for name in TOWER:
                merged.get_parameter(name).copy_(before[name])
        assert (image_logits(merged, sharded_base) - reference).abs().max() > 1e-2
