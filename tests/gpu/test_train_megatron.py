"""`python -m kora_trainer.train` with `backend: megatron`, as a user runs it on a GPU machine: real local Ray
placing the trainer and the reference engine on GPUs (`config/placement.gpu_shares`), the megatron policy
trained by GRPO and pushed to the engine in each sync mode — over NCCL with the engine on its own GPU
(Disaggregated), or in memory on a shared GPU (Colocate).

What says the sync is right: every step, before its first update, the trainer compares its log-probs of the
sampled tokens with the engine's (`rollout_logp_gap_max`, on-policy steps only: deployment.async false).
The toy is fp32 on both sides, so after a correct push they agree to kernel noise; a wrong or missing push
leaves a gap of the adapter's size. Bound 1e-3, the one tests/gpu/test_megatron_sync.py uses.

Run: PYTHONPATH=trainer:engine:tests:/path/to/megatron-core NCCL_NVLS_ENABLE=0 \
    pytest -m gpu tests/gpu/test_train_megatron.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_megatron_model import report

from kora_trainer.backends.megatron import megatron_available
from tinymodel import make_tiny_moe_model
from trainkit import TrainRun, wait_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not megatron_available(), reason="needs megatron-core"),
]
GAP_BOUND = 1e-3
MEGATRON = ["backend=megatron", "deployment.async=false", "rollout.gpusPerEngine=1", "sync.deltaSkipThreshold=0"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """The toy with its dataset as JSON lines: the GPU image has no pyarrow (the model is the same)."""
    from kora_trainer.toys.lm import make_toy

    out = tmp_path_factory.mktemp("toy") / "toy"
    make_toy(out, target=0.0, dataset="train.jsonl")
    return out


def data(toy: Path) -> str:
    return f"data.path={toy}/train.jsonl"


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE (layer 1 dense, 8 experts top-2) with the toy's tokenizer and dataset."""
    from kora_trainer.toys.lm import write_dataset

    out = make_tiny_moe_model(tmp_path_factory.mktemp("moe") / "moe")
    write_dataset(out / "train.jsonl")
    return out


def needs_gpus(deployment: str) -> None:
    if deployment == "Disaggregated" and torch.cuda.device_count() < 2:
        pytest.skip("Disaggregated puts the engine on a GPU of its own: needs 2 GPUs")


@pytest.mark.parametrize(("mode", "deployment"), [
    ("Adapter", "Disaggregated"), ("EngineMerge", "Disaggregated"), ("Merge", "Disaggregated"),
    ("Merge", "Colocate"), ("Adapter", "Colocate"), ("EngineMerge", "Colocate")])
def test_megatron_backend_trains_and_every_sync_mode_serves_the_policy(toy, tmp_path, mode, deployment):
    needs_gpus(deployment)
    run = TrainRun(toy, tmp_path, data(toy), *MEGATRON, f"lora.syncMode={mode}", f"deployment.mode={deployment}",
                   "algorithm.numSteps=4")
    wait_all([run])
    summary = run.summary()
    assert summary["backend"] == "MegatronBackend", run.output[-2000:]
    start = run.events("start")[0]
    assert start["backend"] == "MegatronBackend" and str(start["device"]).startswith("cuda")
    assert summary["steps"] == 4 and summary["sync_mode"] == mode
    assert summary["transport"] == ("colocated" if deployment == "Colocate" else "distributed")
    assert summary["sync_bytes_per_step"] > 0 and summary["syncs_skipped"] == 0
    if deployment == "Colocate":  # sync/fast/colocated.py: CUDA IPC, planned once
        assert set(summary["sync_paths"]) == {"fast"}, (summary["sync_paths"], run.notes())
        if mode != "Adapter":  # each push told to the engine in shared memory, no HTTP call (the watcher's fold)
            assert any("push handshake in shared memory" in n for n in run.notes()), run.notes()
    gap = summary["rollout_logp_gap_max"]
    assert gap is not None and gap < GAP_BOUND, f"engine vs megatron policy log-probs differ by {gap}"
    assert len(set(summary["loss_curve"])) > 1  # it trained: the loss moved
    report(test="train_megatron", mode=mode, deployment=deployment, steps=summary["steps"], logp_gap_max=gap,
           sync_ms_p50=summary["sync_ms_p50"], bytes_per_step=summary["sync_bytes_per_step"],
           wall_s=summary["wall_s"], sync_paths=summary["sync_paths"])


@pytest.mark.parametrize(("mode", "targets"), [
    ("Adapter", "[linear_qkv,linear_fc1,linear_fc2,router]"), ("EngineMerge", "[linear_qkv,linear_fc1,linear_fc2]"),
    ("Merge", "[linear_qkv,linear_fc1,linear_fc2]")])
def test_megatron_moe_lora_trains_and_the_engine_serves_it(moe, tmp_path, mode, targets):
    """Qwen3-MoE on megatron (SequentialMLP experts): expert LoRA in PEFT's grouped layout, the router's in
    Adapter mode, pushed under per-expert names to the engine's fused experts."""
    needs_gpus("Disaggregated")
    run = TrainRun(moe, tmp_path, data(moe), *MEGATRON, f"lora.syncMode={mode}", f"lora.targetModules={targets}",
                   "lora.rank=4", "lora.alpha=8", "algorithm.numSteps=3")
    wait_all([run])
    summary = run.summary()
    assert summary["backend"] == "MegatronBackend" and summary["steps"] == 3
    gap = summary["rollout_logp_gap_max"]
    assert gap is not None and gap < GAP_BOUND, f"engine vs megatron policy log-probs differ by {gap}"
    assert len(set(summary["loss_curve"])) > 1
    report(test="train_megatron_moe", mode=mode, targets=targets, logp_gap_max=gap,
           sync_ms_p50=summary["sync_ms_p50"], bytes_per_step=summary["sync_bytes_per_step"])


def test_megatron_checkpoints_resume_and_export(toy, tmp_path):
    """A megatron run checkpoints every 2 steps and exports HF-PEFT; a second run on the same directory
    resumes from step 4 and runs only steps 5-6; the export loads with peft on the HF model."""
    needs_gpus("Disaggregated")
    ckpt = tmp_path / "ckpt"
    common = [data(toy), *MEGATRON, "lora.syncMode=Adapter", f"checkpoint.path={ckpt}", "checkpoint.interval=2",
              "checkpoint.exportHF=true"]
    first = TrainRun(toy, tmp_path / "a", *common, "algorithm.numSteps=4")
    wait_all([first])
    assert first.summary()["last_checkpoint"]["step"] == 4
    second = TrainRun(toy, tmp_path / "b", *common, "algorithm.numSteps=6")
    wait_all([second])
    summary = second.summary()
    assert [e["step"] for e in second.events("resume")] == [4]
    assert summary["first_step"] == 5 and summary["steps"] == 2 and summary["resumed_from_step"] == 4
    assert summary["rollout_logp_gap_max"] < GAP_BOUND  # the restored adapter is what the engine serves

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    export = ckpt / "lora_adapter"
    config = json.loads((export / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == Path(toy).resolve()
    base = AutoModelForCausalLM.from_pretrained(toy, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    plain = base(ids).logits
    tuned = PeftModel.from_pretrained(base, str(export))(ids).logits
    assert (tuned - plain).abs().max() > 0  # the exported adapter is the trained one, not zeros

