"""Issue 20 item 3, its text-only part: a tiny Qwen3.5-MoE (transformers 5's Qwen3_5MoeForCausalLM from a config on
disk, tests/gdnkit.py: a GDN layer and an attention layer, each with fused 3-D experts, a bare router weight and a
shared expert) trained by `python -m kora_trainer.train` in Merge and Adapter (router included) modes, side by side:
the engine serves each policy (`rollout_logp_gap_max`, deployment.async false, as test_train_moe.py), checkpoints
restore it, and its HF-PEFT export loads with peft and folds with `kora merge` to the same logits.

Tolerances as in test_export.py (fp32 on CPU): PEFT vs the policy 1e-5 (same ops), merged vs the policy 1e-4 (W + s·BA
folded once); the adapter moves the logits by far more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gdnkit import make_tiny_gdn_moe_model
from kora_trainer.toys.lm import write_dataset
from trainkit import TINY, TOY_YAML, TrainRun, wait_all

STEPS = 3
GAP_BOUND = 1e-3
PEFT_TOL, MERGE_TOL = 1e-5, 1e-4
DENSE = "linear_qkv,linear_proj,in_proj,out_proj,linear_fc1,linear_fc2"
MODES = {"Merge": f"[{DENSE}]", "Adapter": f"[{DENSE},router]"}  # router LoRA is Adapter-only (SPEC rule 5)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    out = make_tiny_gdn_moe_model(tmp_path_factory.mktemp("gdn-moe") / "gdn-moe")
    write_dataset(out / "train.jsonl")
    return out


def job(moe_dir: Path, ckpt: Path, mode: str) -> list[str]:
    return [f"data.path={moe_dir}/train.jsonl", "deployment.async=false", "sync.deltaSkipThreshold=0",
            f"algorithm.numSteps={STEPS}", "lora.rank=4", "lora.alpha=8", "algorithm.lr=0.02",
            f"lora.syncMode={mode}", f"lora.targetModules={MODES[mode]}", f"checkpoint.path={ckpt}",
            "checkpoint.interval=2"]


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()  # [B, T, V]


def check_export(moe_dir: Path, ckpt: Path, mode: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kora_trainer.backends.torch_backend import TorchBackend
    from kora_trainer.checkpoint.merge import merge
    from kora_trainer.checkpoint.training import restore_training_state
    from kora_trainer.config import load_config

    cfg, _ = load_config(str(TOY_YAML), [f"model.path={moe_dir}", *TINY, *job(moe_dir, ckpt, mode)])
    backend = TorchBackend(cfg, device="cpu", threads=1)
    resumed = restore_training_state(ckpt, backend)
    assert resumed is not None and resumed.step == STEPS
    ids = torch.randint(3, 15, (4, 10), generator=torch.Generator().manual_seed(0))
    policy = logits(backend.model, ids)
    base = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    moved = (logits(base, ids) - policy).abs().max().item()
    peft_gap = (logits(PeftModel.from_pretrained(base, ckpt / "lora_adapter").eval(), ids) - policy).abs().max()
    merge(moe_dir, ckpt / "lora_adapter", tmp_path / f"merged-{mode}", progress=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / f"merged-{mode}", dtype=torch.float32).eval()
    merge_gap = (logits(merged, ids) - policy).abs().max().item()
    assert moved > 100 * MERGE_TOL and peft_gap < PEFT_TOL and merge_gap < MERGE_TOL, (moved, peft_gap, merge_gap)


@pytest.mark.slow
def test_a_tiny_qwen3_5_moe_trains_in_both_modes_and_exports(moe_dir, tmp_path):
    runs = {mode: TrainRun(moe_dir, tmp_path / mode, *job(moe_dir, tmp_path / f"ckpt-{mode}", mode), "--save-hf")
            for mode in MODES}
    wait_all(list(runs.values()))
    for mode, run in runs.items():
        summary = run.summary()
        assert summary["steps"] == STEPS and summary["sync_mode"] == mode and summary["syncs_skipped"] == 0
        assert summary["rollout_logp_gap_max"] is not None and summary["rollout_logp_gap_max"] < GAP_BOUND, mode
        assert summary["export"] == str(tmp_path / f"ckpt-{mode}" / "lora_adapter")
    for mode in MODES:
        check_export(moe_dir, tmp_path / f"ckpt-{mode}", mode, tmp_path)
