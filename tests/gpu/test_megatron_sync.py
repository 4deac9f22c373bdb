"""The megatron policy synced to kora's reference engine in all three modes — over NCCL (policy on GPU 1, engine
on GPU 0; 2 GPUs) and colocated through CUDA IPC (both on GPU 0): after each push the engine's log-probs equal
`MegatronBackend.logprobs` (Adapter mode through `lora_path`), then a GRPO step moves the adapter and the next
push lands too; an unchanged adapter is skipped (collective rule).

Run: PYTHONPATH=trainer:engine:tests:/path/to/megatron-core pytest -m gpu tests/gpu/test_megatron_sync.py
Tolerance: fp32 on both sides, TF32 off (torch's default for matmuls): engine vs trainer log-probs 1e-3
absolute (the engine batches and KV-caches, the trainer runs one forward; megatron vs HF logits agree to
~2e-6, docs/megatron_backend.md). Every push is also checked byte for byte by the engine's checksum.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch
from test_megatron_model import ALPHA, PROMPT, RESPONSES, REWARDS, TARGETS, R, random_hf_adapter, report

from engine_helpers import PROMPTS, start_engine, stop_engine
from kora_trainer.backends.megatron import megatron_available
from kora_trainer.wire.engine_client import EngineClient
from kora_trainer.wire.ports import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not megatron_available(), reason="needs megatron-core"),
]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL: one rank per GPU)")
ATOL = 1e-3


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    proc = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "--dtype", "float32", device="cuda")  # GPU 0
    with EngineClient(proc.url, timeout=120) as c:
        yield c
    stop_engine(proc)


@contextmanager
def megatron_on(gpu: int):
    """megatron's process group + parallel state on GPU `gpu` (LOCAL_RANK picks the device in init_parallel)."""
    from kora_trainer.backends.megatron.parallel import destroy_parallel, init_parallel

    saved = {k: os.environ.get(k) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    os.environ.update(LOCAL_RANK=str(gpu), RANK="0", WORLD_SIZE="1", MASTER_PORT=str(free_port()))
    torch.backends.cuda.matmul.allow_tf32 = False
    init_parallel(1)
    try:
        yield
    finally:
        destroy_parallel()
        torch.cuda.set_device(0)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cfg(model_dir, mode: str):
    from kora_trainer.config import load_config

    overrides = [f"model.path={model_dir}", "data.path=unused.parquet", f"lora.rank={R}", f"lora.alpha={ALPHA}",
                 f"lora.syncMode={mode}", "algorithm.lr=0.01", "algorithm.innerEpochs=1", "algorithm.klCoef=0.0",
                 "sync.bufferSize=20000"]  # small buckets: several per push, tensors split over buckets
    cfg, _ = load_config(None, overrides, base={"lora": {"rank": R, "targetModules": TARGETS},
                                                "rollout": {"engine": "hf"}})  # kora's reference engine
    return cfg


def engine_gap(client: EngineClient, mg, lora_path: str | None) -> float:
    """Largest |engine log-prob - megatron log-prob| over greedy continuations of PROMPTS."""
    outs = client.generate(PROMPTS, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                           lora_path=lora_path)
    mine = mg.logprobs([list(p) for p in PROMPTS], [list(o.output_ids) for o in outs])
    return max(abs(a - b) for o, m in zip(outs, mine, strict=True) for a, b in zip(o.output_logprobs, m, strict=True))


def run_modes(client: EngineClient, model_dir, transport, gpu: int) -> list[dict]:
    """Adapter, EngineMerge, Merge: two pushes each (a GRPO step between), log-probs checked after every push."""
    from kora_trainer.backends.batch import RolloutBatch
    from kora_trainer.backends.megatron.backend import MegatronBackend
    from kora_trainer.backends.megatron.export import load_hf_adapter
    from kora_trainer.backends.megatron.sync import MegatronWeightSender

    mg = MegatronBackend(_cfg(model_dir, "Merge"), dtype=torch.float32)
    assert mg.device == torch.device("cuda", gpu)
    load_hf_adapter(mg.model, random_hf_adapter(mg.layout, mg.hf_config, TARGETS, std=0.1), mg.layout)
    prompts = [list(p) for p in PROMPTS]
    outs = client.generate(prompts, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True})
    cont = [list(o.output_ids) for o in outs]
    effect = max(abs(a - b) for x, y in zip(mg.logprobs(prompts, cont), mg.logprobs(prompts, cont, adapter=False),
                                            strict=True) for a, b in zip(x, y, strict=True))
    results: list[dict] = [{"adapter_effect": effect}]
    assert effect > 0.05  # the adapter really changes the policy, so a push that missed it would show
    version = 100 * gpu
    for mode in ("Adapter", "EngineMerge", "Merge"):
        sender = MegatronWeightSender(mg.model, mg.layout, _cfg(model_dir, mode), transport)
        lora_path = "kora-policy" if mode == "Adapter" else None
        for step in range(2):
            version += 1
            rep = sender.sync(version)
            assert rep.pushed and rep.buckets >= 1, rep
            gap = engine_gap(client, mg, lora_path)
            results.append({"mode": mode, "step": step, "what": rep.what, "bytes": rep.bytes, "ms": rep.ms,
                            "buckets": rep.buckets, "logprob_max_abs": gap})
            assert gap < ATOL, (mode, step, gap)
            old = mg.logprobs([PROMPT] * len(RESPONSES), RESPONSES)  # one GRPO step moves the adapter
            mg.train_step(RolloutBatch([PROMPT] * len(RESPONSES), RESPONSES, old, REWARDS, group_size=4))
        # after one more push, an unchanged adapter is skipped
        version += 1
        assert sender.sync(version).pushed
        skipped = sender.sync(version + 1)
        assert not skipped.pushed and skipped.what == "skipped" and skipped.max_delta == 0.0
    return results


@TWO_GPUS
def test_three_sync_modes_over_nccl(client, model_dir):
    from kora_trainer.sync.transport import DistributedTransport

    with megatron_on(1):  # the engine is on GPU 0
        transport = DistributedTransport.connect([client], backend="nccl")
        try:
            results = run_modes(client, model_dir, transport, gpu=1)
        finally:
            transport.close()
    report(test="megatron_sync_modes_nccl_fp32", tolerance=ATOL, results=results)


def test_three_sync_modes_colocated_cuda_ipc(client, model_dir):
    from kora_trainer.sync.transport import ColocatedTransport

    with megatron_on(0):  # the engine's GPU: tensors handed over as CUDA IPC handles
        results = run_modes(client, model_dir, ColocatedTransport([client]), gpu=0)
    report(test="megatron_sync_modes_cuda_ipc_fp32", tolerance=ATOL, results=results)
