"""The trainer at parallelism.tensor 2, at parallelism.pipeline 2 and (a tiny Qwen3-MoE) at parallelism.expert 2 and
at tensor 2 x expert 2 (sequence parallel) on GPUs (megatron: one Ray actor per rank, a GPU each, NCCL; pipeline
stages through megatron's 1F1B schedule, experts through its all-to-all dispatcher), Colocate (an engine on each
rank's GPU, each rank feeding its own: 2 GPUs) and Disaggregated (rank 0 broadcasting to an engine on a GPU of its
own: 3 GPUs), each against the same job on one GPU; then the split job resumed from its checkpoint continues, and
the export is written (tests/model_parallel_runs.py). Skipped below the GPUs a case needs; the two-GPU issue runs
them. On the CPU, tests/e2e/test_train_model_parallel_cpu.py runs the same cases through the same train command,
and tests/unit/test_megatron_model_parallel.py the policies, checkpoints and pushes over gloo.

Run: PYTHONPATH=$PWD/trainer:$PWD/engine:$PWD/tests:/path/to/megatron-core NCCL_NVLS_ENABLE=0 \
    pytest -m gpu tests/gpu/test_train_model_parallel_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from kora_trainer.backends.megatron import megatron_available
from model_parallel_runs import SPLITS, make_toys, split_takes_the_steps_of_one

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1500),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs"),
              pytest.mark.skipif(not megatron_available(), reason="needs megatron-core")]
STEPS = 5


@pytest.fixture(scope="module")
def toys(tmp_path_factory):
    return make_toys(tmp_path_factory.mktemp("toys"))


@pytest.mark.parametrize("mode", ["Merge", "Adapter", "EngineMerge"])
@pytest.mark.parametrize(("deployment", "engines", "gpus"), [("Colocate", 2, 2), ("Disaggregated", 1, 3)])
@pytest.mark.parametrize("split", list(SPLITS))
def test_a_model_split_over_2_gpus_takes_the_steps_of_one_gpu_and_resumes(toys, tmp_path, mode, deployment,
                                                                          engines, gpus, split):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{split} 2 {deployment} needs {gpus} GPUs")
    ranks = split_takes_the_steps_of_one(*toys, tmp_path, split, mode, deployment, engines, "rollout.gpusPerEngine=1",
                                         steps=STEPS)
    assert len({r["gpus"][0] for r in ranks}) == 2  # a GPU each
