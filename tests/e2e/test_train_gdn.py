"""`python -m kora_trainer.train` on a tiny Qwen3.5-style hybrid (tests/gdnkit.py: two GDN linear-attention layers
around a full-attention one, transformers 5's Qwen3_5ForCausalLM) with the torch backend: LoRA on attention and the
GDN in_proj / out_proj, trained by GRPO and pushed to the reference engine. Each step compares the trainer's
log-probs of the sampled tokens with the engine's before its first update (`rollout_logp_gap_max`, deployment.async
false), as test_train_moe.py does:

- Merge folds every GDN row (gates included) into the pushed weights;
- Adapter pins the b/a gate adapters (the stock build serves none: config/engine_lora_limits.py) and pushes the rest
  under SGLang's fused names; both keep the gap at float noise;
- Adapter with the pin off (the test-only GATE_MASK_OFF_ENV) trains gates the engine never gets: the gap shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gdnkit import GDN_TARGETS, make_tiny_gdn_model
from kora_trainer.lora.gdn import GATE_MASK_OFF_ENV
from kora_trainer.toys.lm import write_dataset
from trainkit import TrainRun, wait_all

GAP_BOUND = 1e-3
# lr 5e-2: a few steps move the unpinned gates far enough to see; the served check must not stop the run
COMMON = ["deployment.async=false", "sync.deltaSkipThreshold=0", "algorithm.numSteps=3", "lora.rank=4",
          "lora.alpha=8", f"lora.targetModules={GDN_TARGETS}", "algorithm.lr=0.05", "sync.servedLogpGapMax=100"]


@pytest.fixture(scope="module")
def gdn_dir(tmp_path_factory) -> Path:
    out = make_tiny_gdn_model(tmp_path_factory.mktemp("gdn") / "gdn")
    write_dataset(out / "train.jsonl")
    return out


def started(gdn_dir: Path, tmp_path: Path, mode: str, env: dict[str, str] | None = None) -> TrainRun:
    return TrainRun(gdn_dir, tmp_path, f"data.path={gdn_dir}/train.jsonl", *COMMON, f"lora.syncMode={mode}", env=env)


def gap_of(r: TrainRun, mode: str) -> float:
    summary = r.summary()
    assert summary["steps"] == 3 and summary["sync_mode"] == mode and summary["syncs_skipped"] == 0
    assert len(set(summary["loss_curve"])) > 1
    gap = summary["rollout_logp_gap_max"]
    assert gap is not None
    return float(gap)


@pytest.mark.slow
def test_gdn_lora_trains_in_merge_mode_and_the_engine_serves_it(gdn_dir, tmp_path):
    r = started(gdn_dir, tmp_path, "Merge")
    wait_all([r])
    assert gap_of(r, "Merge") < GAP_BOUND


@pytest.mark.slow
def test_gdn_lora_trains_in_adapter_mode_and_only_unpinned_gates_leave_a_gap(gdn_dir, tmp_path):
    pinned = started(gdn_dir, tmp_path / "pinned", "Adapter")
    unpinned = started(gdn_dir, tmp_path / "unpinned", "Adapter", env={GATE_MASK_OFF_ENV: "1"})
    wait_all([pinned, unpinned])  # side by side: one start-up's wait for both
    assert gap_of(pinned, "Adapter") < GAP_BOUND
    assert gap_of(unpinned, "Adapter") > 10 * GAP_BOUND  # gates the engine never got
