"""`python -m kora_trainer.train` on a Qwen3-MoE (transformers 5: fused 3-D experts, bare router weight) with the
torch backend: LoRA on attention, the experts' gate_up / down and (Adapter mode) the router, trained by GRPO
and pushed to the reference engine. Each step compares the trainer's log-probs of the sampled tokens with the
engine's before its first update (`rollout_logp_gap_max`, deployment.async false): after a correct sync they
agree to float noise; an expert or router adapter the engine did not get would leave a gap of its size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kora_trainer.toys.lm import write_dataset
from tinymodel import make_tiny_moe_model
from trainkit import TrainRun, wait_all

GAP_BOUND = 1e-3
COMMON = ["deployment.async=false", "sync.deltaSkipThreshold=0", "algorithm.numSteps=3", "lora.rank=4",
          "lora.alpha=8"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    out = make_tiny_moe_model(tmp_path_factory.mktemp("moe") / "moe")
    write_dataset(out / "train.jsonl")
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "targets"), [
    pytest.param("Merge", "[linear_qkv,linear_fc1,linear_fc2]", marks=pytest.mark.full),
    ("Adapter", "[linear_qkv,linear_fc1,linear_fc2,router]"),
    ("EngineMerge", "[linear_qkv,linear_fc1,linear_fc2]"),
])
def test_moe_lora_trains_and_the_engine_serves_it(moe_dir, tmp_path, mode, targets):
    run = TrainRun(moe_dir, tmp_path, f"data.path={moe_dir}/train.jsonl", *COMMON, f"lora.syncMode={mode}",
                   f"lora.targetModules={targets}")
    wait_all([run])
    summary = run.summary()
    assert summary["steps"] == 3 and summary["sync_mode"] == mode and summary["syncs_skipped"] == 0
    gap = summary["rollout_logp_gap_max"]
    assert gap is not None and gap < GAP_BOUND, f"engine vs trainer log-probs differ by {gap}"
    assert len(set(summary["loss_curve"])) > 1
