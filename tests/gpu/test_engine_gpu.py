"""The reference engine on CUDA: NCCL weight-update group (trainer rank 0 on GPU 1, engine on GPU 0)
and CUDA IPC tensor handoff (both processes on GPU 0). Skipped without 2 GPUs.

Run: pytest -m gpu tests/gpu/test_engine_gpu.py. Tolerance: fp32 on both sides, TF32 off
(torch's default for matmul), so log-probs agree to 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import (
    broadcast_bucket,
    engine_vs_reference,
    load_hf,
    make_peft_adapter,
    peft_config_dict,
    peft_tensors,
    push_weights,
    random_weights,
    start_engine,
    stop_engine,
    trainer_group,
)
from kora_trainer.wire.engine_client import EngineClient
from kora_trainer.wire.protocol import FLAT, plan_buckets
from kora_trainer.wire.serialize import serialize_named_tensors
from tinymodel import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL cannot put two "
                                                                         "ranks on one GPU)")]
GPU_ATOL = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=128, intermediate=256)


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    proc = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "--dtype", "float32", device="cuda")
    with EngineClient(proc.url, timeout=120) as c:
        yield c
    stop_engine(proc)


def test_cuda_engine_matches_reference_and_takes_weights_over_nccl(client, model_dir, tmp_path):
    base_model = load_hf(model_dir, "cuda:0")
    assert engine_vs_reference(client, base_model) < GPU_ATOL
    torch.cuda.set_device(1)  # trainer rank 0 on GPU 1, the engine (rank 1) on GPU 0
    try:
        with trainer_group(client, backend="nccl") as group:
            new = [(n, t.to("cuda:1")) for n, t in random_weights(load_hf(model_dir), seed=7)]
            results = push_weights(client, group, new, cap=20_000, load_format=FLAT, weight_version="nccl-1")
            assert len(results) > 1 and all(r["success"] for r in results)
            reference = load_hf(model_dir, "cuda:0")
            with torch.no_grad():
                params = dict(reference.named_parameters())
                for n, t in new:
                    params[n].copy_(t)
            assert engine_vs_reference(client, reference) < GPU_ATOL

            base = [(n, p.detach().to("cuda:1")) for n, p in base_model.named_parameters()]
            push_weights(client, group, base, cap=1 << 30, load_format=None)  # per-tensor form: no splits
            _, peft_model = make_peft_adapter(model_dir, tmp_path / "a", seed=3, device="cuda:0")
            named = [(n, t.to("cuda:1")) for n, t in peft_tensors(peft_model)]
            tensors = dict(named)
            buckets = plan_buckets([[nt] for nt in named], 5000)
            for i, bucket in enumerate(buckets):  # kora's adapter-over-the-group extension
                fut = client.submit(client.load_lora_adapter_from_distributed, "kora-policy",
                                    peft_config_dict(peft_model), bucket.metadata(), bucket_index=i,
                                    num_buckets=len(buckets))
                broadcast_bucket(group, bucket, tensors, FLAT)
                assert fut.result(timeout=120)["success"]
            assert engine_vs_reference(client, peft_model, lora_path="kora-policy") < GPU_ATOL

            pairs: dict[str, list] = {}
            for n, t in named:
                pairs.setdefault(n.split(".lora_")[0], []).append((n, t))
            for bucket in plan_buckets(list(pairs.values()), 20_000):  # EngineMerge over NCCL
                fut = client.submit(client.update_weights_lora_merge, bucket.metadata(), 8.0, 4, load_format=FLAT)
                broadcast_bucket(group, bucket, tensors, FLAT)
                assert fut.result(timeout=120)["success"]
            assert engine_vs_reference(client, peft_model) < GPU_ATOL
    finally:
        torch.cuda.set_device(0)


def test_cuda_ipc_tensor_routes(client, model_dir, tmp_path):
    torch.cuda.set_device(0)
    base = [(n, p.detach().clone()) for n, p in load_hf(model_dir, "cuda:0").named_parameters()]
    assert client.update_weights_from_tensor(serialize_named_tensors(base), weight_version="ipc")["success"]
    assert engine_vs_reference(client, load_hf(model_dir, "cuda:0")) < GPU_ATOL
    _, peft_model = make_peft_adapter(model_dir, tmp_path / "b", seed=4, device="cuda:0")
    named = peft_tensors(peft_model)  # CUDA tensors: handed over as CUDA IPC handles
    assert named[0][1].is_cuda
    out = client.load_lora_adapter_from_tensors("ipc", peft_config_dict(peft_model), serialize_named_tensors(named))
    assert out["success"]
    assert engine_vs_reference(client, peft_model, lora_path="ipc") < GPU_ATOL
