"""Shared test data: a valid LoRATrainingJob and, for every CEL-backed rule, a way to break it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any


def valid_job(name: str = "job", **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"path": "/nonexistent/models/tiny", "volume": {"hostPath": {"path": "/tmp"}}},
        "lora": {"rank": 8, "syncMode": "Merge"},
        "data": {"path": "/nonexistent/data/train.parquet"},
        "resources": {"workers": 1, "gpusPerWorker": 8},
    }
    spec.update(spec_overrides)
    return {"apiVersion": "kora.dev/v1alpha1", "kind": "LoRATrainingJob",
            "metadata": {"name": name}, "spec": spec}


# multi-LoRA on engine sglang: any build in Colocate, the sglang-miles build also Disaggregated (its adapter route
# over the weight-update group: config/sglang_builds.py); the tests that use this want either deployment
MULTI_LORA_BUILD = {"sglangBuild": "sglang-miles-94949da7"}


def set_path(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node = doc["spec"]
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return doc


# what makes valid_job a valid diffusion job: the diffusion section, on the reference diffusion engine
DIFFUSION: dict[str, Any] = {"diffusion.kind": "image", "rollout.engine": "hf", "rollout.gpusPerEngine": 0}

# rule id -> {dotted spec path: value} that violates exactly that rule
VIOLATIONS: dict[str, dict[str, Any]] = {
    "sglang-args-owned": {"rollout.sglangArgs": ["--attention-backend", "triton", "--port=30001"]},
    "sglang-args-engine": {"rollout.engine": "hf", "rollout.gpusPerEngine": 0,
                           "rollout.sglangArgs": ["--attention-backend", "triton"]},
    "adapter-dp-size": {"lora.syncMode": "Adapter", "rollout.dpSize": 2},
    "router-needs-adapter": {"lora.targetModules": ["linear_qkv", "router"]},
    "adapter-colocate-distributed": {"lora.syncMode": "Adapter", "deployment.mode": "Colocate",
                                     "rollout.distributedEngines": 2},
    "lora-only-async-save": {"checkpoint.loraOnly": True, "checkpoint.asyncSave": True},
    "async-save-not-built": {"checkpoint.loraOnly": False, "checkpoint.asyncSave": True},
    "lora-only-dtype": {"checkpoint.dtype": "fp16"},
    "export-needs-path": {"checkpoint.exportHF": True},
    "steps-or-epochs": {"algorithm.numSteps": 10, "algorithm.numEpochs": 1},
    "global-batch-divides": {"algorithm.rolloutBatchSize": 4, "algorithm.nSamplesPerPrompt": 4,
                             "algorithm.globalBatchSize": 5},
    "custom-reward-path": {"data.rewardType": "custom"},
    "multi-lora-needs-adapter": {"multiLora.maxAdapters": 2},
    "multi-lora-images": {"lora.syncMode": "Adapter", "rollout.sglangBuild": "sglang-miles-94949da7",
                          "multiLora.maxAdapters": 2, "data.imageKey": "image"},
    # valid_job sets no numSteps (one epoch)
    "lr-decay-steps": {"algorithm.lrDecayStyle": "cosine"},
    "min-lr": {"algorithm.lr": 1e-4, "algorithm.minLr": 2e-4},
    "lr-warmup-steps": {"algorithm.lrDecayStyle": "linear", "algorithm.numSteps": 100, "algorithm.lrWarmupSteps": 100},
    # the named SGLang build (valid_job's engine is sglang by default: build 0.5.23)
    "build-engine-merge": {"lora.syncMode": "EngineMerge"},
    "build-multi-lora": {"lora.syncMode": "Adapter", "multiLora.maxAdapters": 2, "deployment.mode": "Disaggregated"},
    "ray-runtime-address": {"runtime.kind": "Ray"},
    "expert-parallel-divides": {"parallelism.expert": 2},
    # valid_job runs on 1 worker x 8 GPUs
    "kuberay-gpus": {"parallelism.data": 16},
    "kuberay-gpus-per-node": {"resources.workers": 2, "resources.gpusPerWorker": 4, "parallelism.tensor": 8},
    "kuberay-cpu-engines": {"resources.gpusPerWorker": 0},
    # a diffusion job (valid as DIFFUSION sets it), broken one way each
    "diffusion-sync-mode": {**DIFFUSION, "lora.syncMode": "Adapter"},
    "diffusion-colocate": {**DIFFUSION, "deployment.mode": "Disaggregated"},
    "diffusion-data-parallel": {**DIFFUSION, "parallelism.tensor": 2},
    "diffusion-data-split": {**DIFFUSION, "parallelism.data": 2, "algorithm.rolloutBatchSize": 3},
    "diffusion-one-engine": {**DIFFUSION, "rollout.numEngines": 2},
    "diffusion-gpu-ranks": {**DIFFUSION, "rollout.gpusPerEngine": 1, "parallelism.data": 2,
                            "algorithm.rolloutBatchSize": 4, "algorithm.nSamplesPerPrompt": 4},
    "diffusion-sync-rollouts": {**DIFFUSION, "deployment.async": True},
    "diffusion-torch": {**DIFFUSION, "backend": "megatron"},
    "diffusion-dropout": {**DIFFUSION, "lora.dropout": 0.1},
    "diffusion-custom-reward": {**DIFFUSION, "diffusion.reward": "custom"},
}


def violating_job(rule_id: str, name: str = "job") -> dict[str, Any]:
    doc = valid_job(name)
    for path, value in VIOLATIONS[rule_id].items():
        doc = set_path(doc, path, value)
    return doc


def multi_adapter_registry(tmp_path: Path) -> tuple[Any, Path]:
    """(an AdapterRegistry of a 2-slot multi-adapter job of max rank 16 on 2 DP ranks, its 8-row dataset): what the
    control plane's /adapter_runs routes stand on in the tests that serve them."""
    from kora_trainer.adapter_runs.registry import AdapterRegistry
    from kora_trainer.config import TrainerConfig

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n' * 8)
    cfg = TrainerConfig.model_validate({
        "model": {"path": str(tmp_path)}, "lora": {"rank": 16, "syncMode": "Adapter"},
        "algorithm": {"rolloutBatchSize": 4, "nSamplesPerPrompt": 4, "globalBatchSize": 16},
        "data": {"path": str(data)}, "multiLora": {"maxAdapters": 2}, "parallelism": {"data": 2}})
    return AdapterRegistry(cfg, tmp_path / "ckpt" / "adapters" / "registry.json"), data
