"""A tensor-parallel (TP = 2) megatron policy synced to kora's reference engine in all three modes (issue 8's
sync half, on two GPUs): TP ranks on GPUs 0 and 1 (NCCL TP group), the engine on GPU 1 (a different
communicator: the weight-update group is {TP rank 0 on GPU 0, the engine on GPU 1}). Every TP rank builds a
`MegatronWeightSender` and calls `sync()`; TP rank 0 holds the transport, TP rank 1 finds itself a follower and
takes part in the shard gathers of every bucket. After each push the engine's log-probs equal the TP = 2
policy's `MegatronBackend.logprobs` (Adapter mode through `lora_path`); a GRPO step on both ranks moves the
adapter and the next push lands too; an unchanged adapter is skipped by both ranks (the MAX over the TP group).

Run (2 GPUs): PYTHONPATH=trainer:engine:tests:/path/to/megatron-core pytest -m gpu tests/gpu/test_megatron_tp_sync.py
Tolerance: that of test_megatron_sync.py (fp32 both sides, TF32 off, 1e-3 absolute); every push is also
checked byte for byte by the engine's checksum.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_megatron_model import PROMPT, RESPONSES, REWARDS, TARGETS, random_hf_adapter, report
from test_megatron_sync import ATOL, _cfg

from engine_helpers import PROMPTS, start_engine, stop_engine
from gpukit import megatron_marks
from kora_trainer.wire.ports import free_port

pytestmark = megatron_marks(gpus=2)
TP = 2
GEN = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def _tp_cfg(model_dir: str, mode: str):
    cfg = _cfg(model_dir, mode)  # test_megatron_sync's: 20 kB buckets, so tensors split over buckets
    return cfg.model_copy(update={"parallelism": cfg.parallelism.model_copy(update={"tensor": TP})})


def run_rank(rank: int, world: int, port: int, model_dir: str, url: str, out: str) -> None:
    """One TP rank: the policy, a sender per mode, log-probs against the engine after every push."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist

    from kora_trainer.backends.batch import RolloutBatch
    from kora_trainer.backends.megatron.backend import MegatronBackend
    from kora_trainer.backends.megatron.export import load_hf_adapter
    from kora_trainer.backends.megatron.parallel import destroy_parallel
    from kora_trainer.backends.megatron.sync import MegatronWeightSender
    from kora_trainer.sync.transport import DistributedTransport
    from kora_trainer.wire.engine_client import EngineClient

    torch.backends.cuda.matmul.allow_tf32 = False
    mg = MegatronBackend(_tp_cfg(model_dir, "Merge"), dtype=torch.float32)  # init_parallel(2): GPU `rank`
    assert mg.device == torch.device("cuda", rank)
    load_hf_adapter(mg.model, random_hf_adapter(mg.layout, mg.hf_config, TARGETS, std=0.1), mg.layout)
    client = EngineClient(url, timeout=120) if rank == 0 else None
    transport = DistributedTransport.connect([client], backend="nccl") if client is not None else None
    prompts = [list(p) for p in PROMPTS]

    def from_rank0(obj: Any) -> Any:
        """What rank 0 saw of the engine, on every TP rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def engine_gap(lora_path: str | None) -> float:
        """Largest |engine - policy| log-prob over the engine's greedy continuations (collective: every rank
        scores rank 0's continuations, the TP forward needs both)."""
        outs = None
        if client is not None:
            outs = [(list(o.output_ids), list(o.output_logprobs)) for o in client.generate(prompts, GEN,
                                                                                          lora_path=lora_path)]
        outs = from_rank0(outs)
        mine = mg.logprobs(prompts, [ids for ids, _ in outs])
        return max(abs(a - b) for (_, lps), m in zip(outs, mine, strict=True) for a, b in zip(lps, m, strict=True))

    base = from_rank0([list(o.output_ids) for o in client.generate(prompts, GEN)] if client is not None else None)
    effect = max(abs(a - b) for x, y in zip(mg.logprobs(prompts, base), mg.logprobs(prompts, base, adapter=False),
                                            strict=True) for a, b in zip(x, y, strict=True))
    assert effect > 0.05  # the adapter really changes the policy, so a push that missed it would show
    results: list[dict] = [{"adapter_effect": effect}]
    version = 0
    try:
        for mode in ("Adapter", "EngineMerge", "Merge"):
            sender = MegatronWeightSender(mg.model, mg.layout, _tp_cfg(model_dir, mode), transport)
            assert sender.transport is transport if rank == 0 else sender.transport.kind == "follower"
            lora_path = "kora-policy" if mode == "Adapter" else None
            for step in range(2):
                version += 1
                rep = sender.sync(version)
                assert rep.pushed and rep.buckets >= 1, rep
                gap = engine_gap(lora_path)
                results.append({"mode": mode, "step": step, "what": rep.what, "bytes": rep.bytes, "ms": rep.ms,
                                "buckets": rep.buckets, "logprob_max_abs": gap, "checksum": rep.checksum})
                assert gap < ATOL, (mode, step, gap)
                old = mg.logprobs([PROMPT] * len(RESPONSES), RESPONSES)  # one GRPO step moves the adapter
                mg.train_step(RolloutBatch([PROMPT] * len(RESPONSES), RESPONSES, old, REWARDS, group_size=4))
            version += 1
            assert sender.sync(version).pushed
            version += 1
            skipped = sender.sync(version)  # unchanged on both ranks: both skip, the MAX is 0
            assert not skipped.pushed and skipped.what == "skipped" and skipped.max_delta == 0.0
        # the follower's pushes were the leader's: same buckets, same bytes, same checksum
        mine = [(r["mode"], r["buckets"], r["bytes"], r["checksum"]) for r in results[1:]]
        theirs = [None] * world
        dist.all_gather_object(theirs, mine)
        assert all(t == theirs[0] for t in theirs), theirs
    finally:
        if transport is not None:
            transport.close()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    destroy_parallel()


@pytest.fixture(scope="module")
def engine_on_gpu1(model_dir, tmp_path_factory):
    """The reference engine (fp32) on the second GPU (its process sees only that one)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    second = visible.split(",")[1] if visible else "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = second
    try:
        proc = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "--dtype", "float32", device="cuda")
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    yield proc
    stop_engine(proc)


def test_three_sync_modes_from_tp2_policy(engine_on_gpu1, model_dir, tmp_path):
    import torch.multiprocessing as mp

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    out = tmp_path / "tp2_sync.json"
    mp.spawn(run_rank, args=(TP, free_port(), str(model_dir), engine_on_gpu1.url, str(out)), nprocs=TP, join=True)
    results = json.loads(out.read_text())
    report(test="megatron_tp2_sync_modes_nccl_fp32", tolerance=ATOL, results=results)
    pushes = results[1:]
    assert {r["mode"] for r in pushes} == {"Adapter", "EngineMerge", "Merge"} and len(pushes) == 6
    assert all(r["logprob_max_abs"] < ATOL for r in pushes)
