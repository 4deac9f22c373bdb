"""The trainer's HF-PEFT export, through a real run: `--save-hf` writes `<checkpoint.path>/lora_adapter/`,
`peft.PeftModel.from_pretrained(base, lora_adapter)` gives the trained policy's logits, and so does the
model `kora merge` folds from it.

The trained policy is the trainer's own: a TorchBackend built from the same config with the run's last
checkpoint restored (checkpoint/training.py, what a resumed run does). Everything is fp32 on CPU:
- PEFT vs the policy: the same ops (base linear + scaling · B·A·x) in the same order; tolerance 1e-5;
- merged vs the policy: W + s·B·A folded once in fp32 changes the rounding; tolerance 1e-4.
The adapter must move the logits by much more than either tolerance, or the comparison would be empty.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kora_trainer.checkpoint import lora_only
from trainkit import TINY, TOY_YAML, TrainRun, wait_all

STEPS = 3
PEFT_TOL, MERGE_TOL = 1e-5, 1e-4


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()  # [B, T, V]


@pytest.mark.slow
def test_exported_adapter_and_merged_model_give_the_trained_policy(toy_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kora_trainer.backends.torch_backend import TorchBackend
    from kora_trainer.checkpoint.training import restore_training_state
    from kora_trainer.config import load_config

    ckpt = tmp_path / "ckpt"
    job = [f"algorithm.numSteps={STEPS}", "lora.syncMode=Adapter", f"checkpoint.path={ckpt}", "checkpoint.interval=2"]
    run = TrainRun(toy_dir, tmp_path / "run", *job, "--save-hf")
    wait_all([run])
    summary = run.summary()
    export = ckpt / "lora_adapter"
    assert summary["export"] == str(export) and summary["last_checkpoint"]["step"] == STEPS
    assert run.events("export") == [{"event": "export", "step": STEPS, "path": str(export),
                                     "wall_s": run.events("export")[0]["wall_s"]}]

    config = json.loads((export / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(toy_dir).resolve())
    assert config["peft_type"] == "LORA" and config["r"] == 16 and config["lora_alpha"] == 32
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])
    meta = json.loads((export / "kora_lora_meta.json").read_text())
    assert meta["step"] == STEPS and meta["sync_mode"] == "Adapter" and meta["base_model"] == str(toy_dir.resolve())
    assert meta["module_map"] == {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"],
                                  "linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"]}
    exported = load_file(str(export / "adapter_model.safetensors"))
    assert exported and all(n.startswith("base_model.model.model.layers.") and
                            n.endswith((".lora_A.weight", ".lora_B.weight")) for n in exported)
    saved = lora_only.load_dir(ckpt / f"step_{STEPS:08d}").adapter  # the same step's checkpoint, as trained
    assert exported.keys() == saved.keys() and all(torch.equal(exported[n], saved[n]) for n in saved)

    # the trainer's policy: the same config, the run's last checkpoint restored
    cfg, _ = load_config(str(TOY_YAML), [f"model.path={toy_dir}", f"data.path={toy_dir}/train.parquet", *TINY, *job])
    backend = TorchBackend(cfg, device="cpu", threads=1)
    resumed = restore_training_state(ckpt, backend)
    assert resumed is not None and resumed.step == STEPS and backend.version == STEPS
    ids = torch.randint(3, backend.model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    policy = logits(backend.model, ids)
    base = AutoModelForCausalLM.from_pretrained(toy_dir, dtype=torch.float32).eval()
    moved = (logits(base, ids) - policy).abs().max().item()

    peft_model = PeftModel.from_pretrained(base, export).eval()
    peft_gap = (logits(peft_model, ids) - policy).abs().max().item()

    merged_dir = tmp_path / "merged"
    kora = Path(sys.executable).with_name("kora")
    argv = [str(kora), "merge", "--base", str(toy_dir), "--adapter", str(export), "--out", str(merged_dir)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    merge_gap = (logits(merged, ids) - policy).abs().max().item()
    print(f"max |logit| difference: adapter vs base {moved:.3g}, PEFT vs trainer {peft_gap:.3g} (tol {PEFT_TOL}), "
          f"kora merge vs trainer {merge_gap:.3g} (tol {MERGE_TOL})")
    assert moved > 100 * MERGE_TOL, "the trained adapter barely moves the logits: the comparison says nothing"
    assert peft_gap <= PEFT_TOL
    assert merge_gap <= MERGE_TOL
