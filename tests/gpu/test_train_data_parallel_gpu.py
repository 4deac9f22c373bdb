"""The trainer at parallelism.data 2 on GPUs (one rank per GPU, NCCL): the megatron and the torch backend, Colocate
(each engine on its rank's GPU: 2 GPUs) and Disaggregated (the engines on GPUs of their own: 4 GPUs), each against
the same job at data 1 (tests/e2e/test_train_data_parallel.py's claim on GPUs: the same losses up to the order of
the sums; fp32 toy). Skipped below the GPUs a case needs; the two-GPU issue runs them.

Run: PYTHONPATH=$PWD/trainer:$PWD/engine:$PWD/tests:/path/to/megatron-core NCCL_NVLS_ENABLE=0 \
    pytest -m gpu tests/gpu/test_train_data_parallel_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from kora_trainer.backends.megatron import megatron_available
from trainkit import TrainRun, wait_all

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")]
STEPS = 5
LOSS_TOL = 1e-5  # fp32 on GPU: the reduction order of NCCL's all-reduce and of cuBLAS differs between layouts
GAP_MAX = 1e-3


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from kora_trainer.toys.lm import make_toy

    out = tmp_path_factory.mktemp("toy") / "toy"
    make_toy(out, target=0.0, dataset="train.jsonl")
    return out


@pytest.mark.parametrize("backend", ["megatron", "torch"])
@pytest.mark.parametrize(("deployment", "gpus"), [("Colocate", 2), ("Disaggregated", 4)])
def test_data_2_on_gpus_takes_the_steps_of_data_1(toy, tmp_path, backend, deployment, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"data 2 {deployment} needs {gpus} GPUs")
    if backend == "megatron" and not megatron_available():
        pytest.skip("needs megatron-core")
    common = (f"data.path={toy}/train.jsonl", f"backend={backend}", f"deployment.mode={deployment}",
              "deployment.async=false", "rollout.gpusPerEngine=1", "rollout.numEngines=2",
              f"algorithm.numSteps={STEPS}", "checkpoint.interval=100")
    runs = [TrainRun(toy, tmp_path / f"data{d}", f"parallelism.data={d}", f"checkpoint.path={tmp_path}/ckpt{d}",
                     *common) for d in (1, 2)]
    wait_all(runs)
    one, two = (r.summary() for r in runs)
    start = runs[1].events("start")[0]
    assert start["world"] == 2 and len({r["gpus"][0] for r in start["ranks"]}) == 2  # a GPU each
    diffs = [abs(a - b) for a, b in zip(one["loss_curve"], two["loss_curve"], strict=True)]
    assert max(diffs) < LOSS_TOL, (one["loss_curve"], two["loss_curve"])
    gaps = [e["rollout_logp_gap_max"] for e in runs[1].events("step")]
    assert None not in gaps and max(gaps) < GAP_MAX, gaps
