"""Issue 20 item 3, the VL part: the MoE + GDN + VL shape of Qwen3.6-35B-A3B in miniature (`kora make-toy --vl --moe`:
a Qwen3_5MoeForConditionalGeneration, GDN + attention layers with fused 3-D experts, a router and a shared expert,
and the one-block vision tower) trained by `python -m kora_trainer.train` on image prompts, side by side:

- Merge, scope all: the recipe's dense targets plus the experts (linear_fc1/linear_fc2) in the language model AND the
  tower, folded and pushed whole; a checkpoint resumes the run; the export loads with peft on the MoE VL class and
  `kora merge` of it keeps vision_config and gives peft's logits on image prompts;
- Adapter, scope language (+ router LoRA, Adapter-only by SPEC rule 5): the base once, then the language adapter.

Each step compares the trainer's log-probs with the engine's (`rollout_logp_gap_max`, async off) as test_train_vl.py.
Tolerances as test_train_gdn_moe.py (fp32 on CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainkit import REPO, TrainRun, wait_all

VL_YAML = REPO / "trainer" / "examples" / "vl_toy.yaml"
GAP_BOUND = 1e-3
PEFT_TOL, MERGE_TOL = 1e-5, 1e-4
STEPS = 2
DENSE = "linear_qkv,linear_proj,in_proj,out_proj,linear_fc1,linear_fc2"  # the Relax recipe's targets
COMMON = ["algorithm.rolloutBatchSize=8", "algorithm.nSamplesPerPrompt=4", "algorithm.globalBatchSize=16",
          "sync.deltaSkipThreshold=0", "checkpoint.interval=1"]


@pytest.fixture(scope="module")
def vl_moe_dir(tmp_path_factory) -> Path:
    from kora_trainer.toys.vl import make_vl_toy

    out = tmp_path_factory.mktemp("vl_moe") / "vl_moe"
    info = make_vl_toy(out, moe=True)
    assert info["architecture"] == "Qwen3_5MoeForConditionalGeneration"
    return out


def vl_run(toy: Path, work: Path, steps: int, *overrides: str) -> TrainRun:
    return TrainRun(toy, work, *COMMON, f"algorithm.numSteps={steps}", *overrides, config=VL_YAML,
                    base=[f"model.path={toy}", f"data.path={toy}/train.parquet"])


def checked(r: TrainRun, mode: str, steps: int) -> dict:
    s = r.summary()
    assert s["steps"] == steps and s["sync_mode"] == mode and s["syncs_skipped"] == 0, r.output[-2000:]
    assert s["rollout_logp_gap_max"] is not None and s["rollout_logp_gap_max"] < GAP_BOUND, (mode, s)
    return s


def image_logits(model: torch.nn.Module, toy: Path) -> torch.Tensor:
    """The last position's logits for 8 image prompts (one per colour), built as the rollout manager builds them."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from kora_trainer.toys.vl import PROMPT, image_png
    from kora_trainer.wire.vision import VisionTokens, forward_inputs, images_from_bytes, prompt_ids

    tokenizer, processor = AutoTokenizer.from_pretrained(toy), AutoImageProcessor.from_pretrained(toy)
    tokens = VisionTokens.of(model.config)
    images = [images_from_bytes(processor, [image_png(c, 0)]) for c in range(8)]
    ids = torch.tensor([prompt_ids(tokenizer, tokens, PROMPT, im) for im in images])
    mask = torch.ones_like(ids)
    kwargs, _ = forward_inputs(model, ids, mask, images, tokens.image, [ids.shape[1]] * len(images))
    with torch.no_grad():
        return model.eval()(attention_mask=mask, **kwargs).logits[:, -1].float()  # [8, V]


@pytest.mark.slow
def test_the_moe_vl_toy_trains_resumes_exports_and_merges(vl_moe_dir, tmp_path):
    from peft import PeftModel

    from kora_trainer.checkpoint.merge import merge
    from kora_trainer.wire.vision import load_policy_model

    ckpt = tmp_path / "ckpt"
    merge_args = ("lora.syncMode=Merge", "lora.scope=all", f"lora.targetModules=[{DENSE}]", f"checkpoint.path={ckpt}")
    merge_run = vl_run(vl_moe_dir, tmp_path / "merge", STEPS, *merge_args)
    adapter = vl_run(vl_moe_dir, tmp_path / "adapter", STEPS, "lora.syncMode=Adapter", "lora.scope=language",
                     f"lora.targetModules=[{DENSE},router]")
    wait_all([merge_run, adapter])  # side by side: one start-up's wait for both
    checked(merge_run, "Merge", STEPS)
    a = checked(adapter, "Adapter", STEPS)
    weights = sum(f.stat().st_size for f in vl_moe_dir.glob("*.safetensors"))
    assert a["sync_bytes_per_step"] < 0.3 * weights  # the language adapter only, not the base

    resumed = vl_run(vl_moe_dir, tmp_path / "resume", STEPS + 1, *merge_args, "--save-hf")
    wait_all([resumed])
    r = resumed.summary()
    assert r["resumed_from_step"] == STEPS and r["first_step"] == STEPS + 1 and r["steps"] == 1, r
    assert r["rollout_logp_gap_max"] < GAP_BOUND
    # a restarted trainer pushes the whole merged model first (tower included: the engine may hold anything), then
    # only what a fold changes (scope all: the tower's adapted weights too, the frozen rest already there)
    first, step = resumed.events("start")[0]["sync"], resumed.events("step")[0]["sync"]
    assert first["what"] == "full" and first["bytes"] >= 0.9 * weights, first
    assert step["what"] == "adapted" and 0.3 * weights < step["bytes"] < first["bytes"], (step, first)

    export = ckpt / "lora_adapter"
    config = json.loads((export / "adapter_config.json").read_text())
    assert "model.visual.blocks.0.attn.qkv" in config["target_modules"]
    assert "mlp.experts.gate_up_proj" in config["target_parameters"]
    base = load_policy_model(str(vl_moe_dir), dtype=torch.float32)
    assert type(base).__name__ == "Qwen3_5MoeForConditionalGeneration"
    base_logits = image_logits(base, vl_moe_dir)
    peft_model = PeftModel.from_pretrained(base, str(export))
    wrapped = [n for n, mod in peft_model.named_modules() if hasattr(mod, "lora_A")]
    assert sum(".visual." in n for n in wrapped) == 6 and any(n.endswith("mlp.experts") for n in wrapped), wrapped
    # the wrapped HF model (peft's LoRA layers in it): wire/vision.py reads the VL class's own inner model
    peft_logits = image_logits(peft_model.get_base_model(), vl_moe_dir)

    merged_dir = tmp_path / "merged"
    merge(vl_moe_dir, export, merged_dir, progress=False)
    assert "vision_config" in json.loads((merged_dir / "config.json").read_text())
    merged = load_policy_model(str(merged_dir), dtype=torch.float32)
    assert type(merged).__name__ == "Qwen3_5MoeForConditionalGeneration"
    moved = (peft_logits - base_logits).abs().max().item()
    merge_gap = (image_logits(merged, vl_moe_dir) - peft_logits).abs().max().item()
    assert moved > 10 * MERGE_TOL and merge_gap < MERGE_TOL, (moved, merge_gap)
