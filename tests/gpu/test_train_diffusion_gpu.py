"""A diffusion job on one GPU through the train command (issue 23): rollout.gpusPerEngine 1 puts the reference
diffusion engine and the trainer on the same GPU, and every push goes as CUDA IPC handles of the trainer's tensors.
Both of the seed's LoRA modes: the engine serves each pushed policy (its per-step log-probs equal the trainer's
re-score within GPU rounding: the two sides run different batch sizes, so cuBLAS may pick other kernels) and the
two modes train the same curve. The realistic shape and the push-time ratio are bench/diffusion_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from trainkit import REPO, TrainRun, wait_all

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPU_GAP = 1e-4
STEPS = 4


def run(toy, work, *overrides):
    """tests/e2e/test_train_diffusion.py's job (4 prompts x 4 images of 4 denoising steps) on the GPU."""
    return TrainRun(toy, work, "rollout.gpusPerEngine=1", *overrides,
                    config=REPO / "trainer" / "examples" / "diffusion_toy.yaml",
                    base=[f"model.path={toy}", f"data.path={toy}/prompts.jsonl", "algorithm.rolloutBatchSize=4",
                          "algorithm.nSamplesPerPrompt=4", "diffusion.numInferenceSteps=4"])


def curve(r):
    return [(e["step"], e["loss"], e["reward_mean"]) for e in r.events("step")]


def test_both_modes_train_on_the_gpu_and_the_engine_serves_every_pushed_policy(diffusion_toy_dir, tmp_path):
    runs = {mode: run(diffusion_toy_dir, tmp_path / mode, f"lora.syncMode={mode}", f"algorithm.numSteps={STEPS}")
            for mode in ("EngineMerge", "Merge")}
    wait_all(list(runs.values()))
    for r in runs.values():
        assert r.proc.returncode == 0, r.output[-3000:]
        assert r.events("start")[0]["device"] == "cuda", r.events("start")
        steps = r.events("step")
        assert len(steps) == STEPS and all(e["sync"]["pushed"] for e in steps)
        assert all(e["rollout_logp_gap_max"] < GPU_GAP for e in steps), [e["rollout_logp_gap_max"] for e in steps]
    want, got = curve(runs["EngineMerge"]), curve(runs["Merge"])
    for (_, loss_a, reward_a), (_, loss_b, reward_b) in zip(want, got, strict=True):
        assert abs(reward_a - reward_b) < 1e-4 and abs(loss_a - loss_b) < 1e-4, (want, got)
    assert want[-1][2] != want[0][2]
