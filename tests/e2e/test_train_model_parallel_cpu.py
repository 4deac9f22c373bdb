"""The train command with backend megatron split over 2 rank actors on the CPU: tensor 2, pipeline 2, and a tiny
Qwen3-MoE at expert 2 and tensor 2 x expert 2, Colocate (each rank feeding the engine beside it) and Disaggregated
(rank 0 feeding one engine over the weight-update group), against the same job in one process, then resumed
(tests/model_parallel_runs.py says what is checked). This is the GPU file tests/gpu/test_train_model_parallel_gpu.py
through the same command, orchestration and engines; only megatron-core's CUDA calls are replaced, in the rank
actors alone, by tests/megatron_cpu.py (a test double for CUDA, which cannot run here), installed there through
tests/megatron_cpu_site/sitecustomize.py on the run's PYTHONPATH.

The CI-size suite runs two cases, one dense and one MoE, each ~2.5 min on 2 cores; `make test-full` the rest.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kora_trainer.backends.megatron import megatron_available
from model_parallel_runs import SPLITS, make_toys, split_takes_the_steps_of_one
from trainkit import E2E, REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(not megatron_available(), reason="needs megatron-core (the test group installs it)"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for CUDA; tests/gpu covers GPUs")]
STEPS = 3
SITE = Path(__file__).resolve().parents[1] / "megatron_cpu_site"
# CI runs one split through the whole trainer; the expert split's engines are served in the unit tests
# (test_megatron_model_parallel.py SPLITS), its trainer runs under `make test-full`
CI = {("tensor", "Merge", "Colocate")}


@pytest.fixture(scope="module")
def toys(tmp_path_factory):
    return make_toys(tmp_path_factory.mktemp("toys"))


def cases():
    for split in SPLITS:
        for mode in ("Merge", "Adapter", "EngineMerge"):
            for deployment in ("Colocate", "Disaggregated"):
                marks = () if (split, mode, deployment) in CI else (pytest.mark.full,)
                yield pytest.param(split, mode, deployment, marks=marks, id=f"{split}-{mode}-{deployment}")


@pytest.mark.parametrize(("split", "mode", "deployment"), list(cases()))
def test_a_model_split_over_2_ranks_takes_the_steps_of_one_and_resumes(toys, tmp_path, split, mode, deployment):
    # the run's processes find the site first; the Ray workers inherit the driver's environment
    path = os.pathsep.join([str(SITE), str(E2E), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {"KORA_TEST_MEGATRON_CPU": "1", "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    engines = 2 if deployment == "Colocate" else 1
    ranks = split_takes_the_steps_of_one(*toys, tmp_path, split, mode, deployment, engines, steps=STEPS, env=env)
    assert all(r["backend"] == "MegatronBackend" and r["device"] == "cpu" for r in ranks)  # megatron, no GPU
