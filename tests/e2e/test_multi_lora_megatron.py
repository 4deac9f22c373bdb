"""Multi-LoRA on the megatron backend through the real trainer (`python -m kora_trainer.train`, Ray, the reference
engine): two adapters of different ranks, rewards and step counts on the toy, split over 2 rank actors (data 2,
tensor 2), megatron-core on the CPU in the rank actors alone (tests/megatron_cpu.py, through
tests/megatron_cpu_site/sitecustomize.py, as tests/e2e/test_train_model_parallel_cpu.py runs it).

What a user would notice: the job the torch backend runs (tests/e2e/test_multi_lora.py) runs on megatron — each
adapter Succeeded at its numSteps, every step's rollouts served by its own adapter at its own version as the ranks
hold it (the engine-vs-trainer gap under GAP_MAX, megatron's bound), each push moving only the adapter that stepped,
its checkpoint and HF-PEFT export written once (global rank 0) with its own rank; the adapter trained beside
the other ends exactly (bit for bit) as the same adapter trained alone at the same split; and a job killed at
tensor 2 after the adapters' first checkpoints resumes each from its own (split back over the TP ranks).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from test_multi_lora import EVEN, factors, job_file

from kora_trainer.backends.megatron import megatron_available
from trainkit import E2E, REPO, TrainRun, wait_all

pytestmark = [pytest.mark.slow, pytest.mark.full, pytest.mark.timeout(1200),
              pytest.mark.skipif(not megatron_available(), reason="needs megatron-core (the test group installs it)"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for CUDA; tests/gpu covers GPUs")]
SITE = Path(__file__).resolve().parents[1] / "megatron_cpu_site"
GAP_MAX = 1e-3  # as the single-adapter megatron runs (tests/model_parallel_runs.py)


def megatron_cpu_env() -> dict[str, str]:
    path = os.pathsep.join([str(SITE), str(E2E), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    return {"KORA_TEST_MEGATRON_CPU": "1", "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("split", ["parallelism.data=2", "parallelism.tensor=2"], ids=["data2", "tensor2"])
def test_megatron_adapters_train_side_by_side_and_an_adapter_alone_ends_the_same(toy_dir, tmp_path, split):
    data = str(toy_dir / "train.parquet")
    a = {"name": "odd", "rank": 16, "numSteps": 3}
    b = {"name": "even", "rank": 8, "numSteps": 2, "seed": 7, "data": {**EVEN, "path": data}}
    # one after the other: two Ray clusters of 2 megatron ranks each starting at once overload a 2-core machine
    both = TrainRun(toy_dir, tmp_path / "both", "backend=megatron", split, env=megatron_cpu_env(),
                    config=job_file(toy_dir, tmp_path / "both", [a, b]))
    wait_all([both], timeout_s=900)
    assert both.proc.returncode == 0, both.output[-4000:]
    alone = TrainRun(toy_dir, tmp_path / "alone", "backend=megatron", split, env=megatron_cpu_env(),
                     config=job_file(toy_dir, tmp_path / "alone", [a], max_adapters=1))
    wait_all([alone], timeout_s=900)
    assert alone.proc.returncode == 0, alone.output[-4000:]
    start = both.events("start")[0]
    assert start["world"] == 2
    summary = both.summary()["adapters"]
    assert summary["odd"]["phase"] == "Succeeded" and summary["odd"]["steps"] == 3
    assert summary["even"]["phase"] == "Succeeded" and summary["even"]["steps"] == 2
    steps = both.events("adapter_step")
    for e in steps:
        assert e["rollout_version_lag"] == 0 and e["rollout_logp_gap_max"] is not None, e
        assert e["rollout_logp_gap_max"] <= GAP_MAX, e
        assert e["sync"]["pushed"] and e["sync"]["adapter_version"] == e["step"], e
    pushed = {name: {e["sync"]["bytes"] for e in steps if e["adapter"] == name} for name in ("odd", "even")}
    assert pushed["even"].pop() * 2 == pushed["odd"].pop()  # selective: each push its own adapter's tensors
    config = json.loads((tmp_path / "both" / "ckpt" / "adapters" / "even" / "lora_adapter" /
                         "adapter_config.json").read_text())
    assert config["r"] == 8
    beside, by_itself = factors(tmp_path / "both" / "ckpt", "odd"), factors(tmp_path / "alone" / "ckpt", "odd")
    assert beside.keys() == by_itself.keys()
    assert any(k.endswith("lora_B.weight") and beside[k].abs().max() > 0 for k in beside)
    assert all(bool((beside[k] == by_itself[k]).all()) for k in beside)
    assert alone.summary()["adapters"]["odd"]["reward_curve"] == summary["odd"]["reward_curve"]


def test_a_restarted_megatron_job_resumes_every_adapter_from_its_split_checkpoint(toy_dir, tmp_path):
    """Tensor 2: killed after each adapter's first checkpoint (the slot's factors and AdamW state gathered over the TP
    ranks, written once), the job started again brings both adapters back (each rank its own shards) at their
    checkpointed steps, serves them as trained (the gap at every resumed step) and ends each at its numSteps."""
    data = str(toy_dir / "train.parquet")
    adapters = [{"name": "odd", "rank": 16, "numSteps": 6},
                {"name": "even", "rank": 8, "numSteps": 6, "seed": 7, "data": {**EVEN, "path": data}}]
    job = job_file(toy_dir, tmp_path / "crash", adapters, checkpoint={"interval": 2})
    first = TrainRun(toy_dir, tmp_path / "crash", "backend=megatron", "parallelism.tensor=2", env=megatron_cpu_env(),
                     config=job)
    deadline = time.monotonic() + 600
    while not {e["adapter"] for e in first.events("adapter_checkpoint")} >= {"odd", "even"}:
        assert first.running() and time.monotonic() < deadline, first.output[-3000:]
        time.sleep(0.1)
    first.kill()  # a crash: the registry file and the checkpoints are what is left
    saved = {e["adapter"]: e["step"] for e in first.events("adapter_checkpoint")}
    again = TrainRun(toy_dir, tmp_path / "crash-2", "backend=megatron", "parallelism.tensor=2",
                     env=megatron_cpu_env(), config=job)
    wait_all([again], timeout_s=900)
    assert again.proc.returncode == 0, again.output[-4000:]
    resumed = {e["adapter"]: e["step"] for e in again.events("adapter_loaded")}
    assert set(resumed) == {"odd", "even"} and all(2 <= resumed[n] <= saved[n] + 2 for n in resumed), (resumed, saved)
    for e in again.events("adapter_step"):
        assert e["rollout_logp_gap_max"] is not None and e["rollout_logp_gap_max"] <= GAP_MAX, e
    assert {n: a["step"] for n, a in again.summary()["adapters"].items()} == {"odd": 6, "even": 6}
