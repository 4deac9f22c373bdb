"""`python -m kora_trainer.train` on the vision-language toy (`kora make-toy --vl`, trainer/examples/vl_toy.yaml):
image prompts through the chat template, rollouts with `image_data` on the reference engine's `/generate`, GRPO on
the torch backend with the images in its log-probs, the policy pushed back. Each step compares the trainer's
log-probs of the sampled tokens with the engine's before its first update (`rollout_logp_gap_max`, async off):

- Merge, scope all: adapters on the language model AND the vision tower, folded and pushed whole; the export names
  the tower's modules by path and loads with peft on the VL class;
- Adapter, scope language: the base pushed once, then the language adapter only (SPEC rule 4 keeps the tower out);
- Adapter, scope all: refused at start by rule 4, against the toy's real config.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainkit import REPO, TrainRun, wait_all

VL_YAML = REPO / "trainer" / "examples" / "vl_toy.yaml"
GAP_BOUND = 1e-3
STEPS = 3
COMMON = [f"algorithm.numSteps={STEPS}", "algorithm.rolloutBatchSize=8", "algorithm.nSamplesPerPrompt=4",
          "algorithm.globalBatchSize=16", "sync.deltaSkipThreshold=0"]


def vl_run(toy: Path, work: Path, *overrides: str) -> TrainRun:
    return TrainRun(toy, work, *COMMON, *overrides, config=VL_YAML,
                    base=[f"model.path={toy}", f"data.path={toy}/train.parquet"])


def checked(r: TrainRun, mode: str) -> dict:
    s = r.summary()
    assert s["steps"] == STEPS and s["sync_mode"] == mode and s["syncs_skipped"] == 0, r.output[-2000:]
    assert len(set(s["loss_curve"])) > 1
    assert s["rollout_logp_gap_max"] is not None and s["rollout_logp_gap_max"] < GAP_BOUND
    return s


@pytest.mark.slow
def test_the_vl_toy_trains_in_merge_scope_all_and_adapter_scope_language(vl_toy_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from kora_trainer.wire.vision import load_policy_model

    merge = vl_run(vl_toy_dir, tmp_path / "merge", "lora.syncMode=Merge", "lora.scope=all",
                   f"checkpoint.path={tmp_path / 'ckpt'}", "--save-hf")
    adapter = vl_run(vl_toy_dir, tmp_path / "adapter", "lora.syncMode=Adapter", "lora.scope=language")
    wait_all([merge, adapter])  # side by side: one start-up's wait for both
    m, a = checked(merge, "Merge"), checked(adapter, "Adapter")
    weights = sum(f.stat().st_size for f in vl_toy_dir.glob("*.safetensors"))
    assert m["sync_bytes_per_step"] >= 0.9 * weights  # the whole model, tower included
    assert a["sync_bytes_per_step"] < 0.2 * weights  # the language adapter only

    export = tmp_path / "ckpt" / "lora_adapter"
    config = json.loads((export / "adapter_config.json").read_text())
    assert "model.visual.blocks.0.attn.qkv" in config["target_modules"]
    assert "model.language_model.layers.1.self_attn.q_proj" in config["target_modules"]
    tensors = load_file(str(export / "adapter_model.safetensors"))
    moved = [k for k, v in tensors.items() if ".visual." in k and "lora_B" in k and v.abs().max() > 0]
    assert moved, "the tower's adapters were not trained"
    peft_model = PeftModel.from_pretrained(load_policy_model(str(vl_toy_dir)), str(export))
    wrapped = {n for n, mod in peft_model.named_modules() if hasattr(mod, "lora_A") and ".visual." in n}
    assert len(wrapped) == 6, wrapped  # qkv, proj, the MLP's fc1/fc2, the merger's fc1/fc2


def test_adapter_mode_with_scope_all_is_refused_on_the_vl_toy(vl_toy_dir, tmp_path):
    cmd = [sys.executable, "-m", "kora_trainer.train", "--config", str(VL_YAML), f"model.path={vl_toy_dir}",
           f"data.path={vl_toy_dir}/train.parquet", "lora.syncMode=Adapter", "lora.scope=all",
           "--run-dir", str(tmp_path / "run")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode != 0
    assert "lora.syncMode Adapter with lora.scope all is not supported" in out.stderr
    assert f"{vl_toy_dir}/config.json declares vision_config" in out.stderr
