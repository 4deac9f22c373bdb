"""The trainer at parallelism.data 2 on CPU: two Ray actors (one per rank) in one gloo group, each training on its
share of every minibatch, the adapter gradients summed over the ranks (backends/data_parallel.py). Same seed and
the same rollouts (seeded per sample: checkpoint.path set, async off), so data 2 must take data 1's steps.

Tolerances (what differs is only the order of fp32 sums: each rank sums its share, then the ranks' sums are
added): each step's loss within LOSS_TOL of data 1's (measured ~5e-8), the final adapter within ADAPTER_TOL
(measured ~4e-6 on B entries of ~2e-2 after 5 AdamW steps at lr 2e-3: Adam's normalised update turns the rounding
of the tiniest gradients into a larger share of their step). A wrong share, a missing all-reduce or a double count
moves the first step's loss by ~1e-2.

Per sync mode one data-1 run and two data-2 runs, Colocate (each rank feeds the engine beside it) and
Disaggregated (rank 0 feeds both engines over the weight-update group), at once. The transport does not change
the pushed weights, so one data-1 run is the reference for both; in every data-2 run the engines serve the
policy the ranks hold (the engine-vs-trainer log-prob gap of the sampled tokens)."""

from __future__ import annotations

import pytest

from kora_trainer.checkpoint.lora_only import load_latest
from trainkit import TrainRun, wait_all

STEPS = 5
LOSS_TOL = 1e-6
ADAPTER_TOL = 2e-5
GAP_MAX = 1e-4  # fp32 engine vs trainer log-probs of the sampled tokens, as in the one-rank tests


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["Merge", pytest.param("Adapter", marks=pytest.mark.full),
                                  pytest.param("EngineMerge", marks=pytest.mark.full)])
def test_data_2_takes_the_steps_of_data_1(toy_dir, tmp_path, mode):
    layouts = {"data1": (1, "Disaggregated"), "colocate2": (2, "Colocate"), "disagg2": (2, "Disaggregated")}
    runs = {name: TrainRun(toy_dir, tmp_path / name, f"parallelism.data={d}", f"deployment.mode={dep}",
                           f"checkpoint.path={tmp_path / name / 'ckpt'}", f"lora.syncMode={mode}",
                           f"algorithm.numSteps={STEPS}", "rollout.numEngines=2", "checkpoint.interval=100",
                           "deployment.async=false")
            for name, (d, dep) in layouts.items()}
    wait_all(list(runs.values()))
    ref = runs["data1"].summary()
    ref_adapter = load_latest(tmp_path / "data1" / "ckpt").adapter
    assert ref["steps"] == STEPS and any(x != 0.0 for x in ref["loss_curve"])  # the reference trained
    for name in ("colocate2", "disagg2"):
        run, summary = runs[name], runs[name].summary()
        start = run.events("start")[0]
        assert start["world"] == 2 and [r["rank"] for r in start["ranks"]] == [0, 1]
        assert summary["transport"] == ("colocated" if name == "colocate2" else "distributed")
        diffs = [abs(a - b) for a, b in zip(ref["loss_curve"], summary["loss_curve"], strict=True)]
        assert max(diffs) < LOSS_TOL, f"{name} left data 1's losses: {ref['loss_curve']} vs {summary['loss_curve']}"
        adapter = load_latest(tmp_path / name / "ckpt").adapter
        assert adapter.keys() == ref_adapter.keys()
        worst = max(float((adapter[k] - ref_adapter[k]).abs().max()) for k in adapter)
        assert worst < ADAPTER_TOL, f"{name}: adapter differs from data 1's by {worst:.2e}"
        gaps = [e["rollout_logp_gap_max"] for e in run.events("step")]
        assert None not in gaps and max(gaps) < GAP_MAX, f"{name}: the engines do not serve the policy: {gaps}"
