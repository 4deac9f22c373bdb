"""One trainer, two engines: a sync fans out over ONE weight-update group (trainer rank 0, engines ranks
1 and 2), each bucket broadcast once, and afterwards both engines serve the trainer's policy.

Real parts: two `reference_engine` processes, a gloo group of three ranks, the real `WeightSender`. This is the
CPU half of the four-GPU issue (a TP=2 actor fanning out to two engines); the TP gather is GPU-only.
Tolerance: ATOL from engine_helpers (fp32 on both sides; only summation order differs).
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import ATOL, logprob_gap, start_engine, stop_engine, trained_policy
from kora_trainer.sync.sender import POLICY_ADAPTER, WeightSender
from kora_trainer.sync.transport import DistributedTransport
from tinymodel import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    procs = []
    try:
        for _ in range(2):
            procs.append(start_engine(model_dir, logs, "--max-lora-rank", "8"))
        yield procs
    finally:
        for p in procs:
            stop_engine(p)


@pytest.mark.parametrize(("mode", "seed"), [("Merge", 21), ("Adapter", 22), ("EngineMerge", 23)])
def test_one_group_feeds_both_engines(engines, model_dir, mode, seed):
    b = trained_policy(model_dir, mode, seed, "24Ki", "[linear_qkv, linear_proj]")
    lora_path = POLICY_ADAPTER if mode == "Adapter" else None
    clients = [e.client() for e in engines]
    transport = DistributedTransport.connect(clients, backend="gloo")
    assert transport.group.world_size == 3  # one group: trainer + both engines, not one group per engine
    broadcasts = []
    real_broadcast = transport.group.broadcast
    transport.group.broadcast = lambda t: (broadcasts.append(t.numel()), real_broadcast(t))[1]
    sender = WeightSender(b.model, b.cfg, transport)
    try:
        report = sender.sync(version=1)
        assert report.pushed and report.buckets == len(broadcasts)  # each bucket crossed the group once
        assert sum(broadcasts) == report.bytes  # ... and the bytes were not sent twice for two engines
        for c in clients:
            assert logprob_gap(c, b, lora_path) < ATOL
        with torch.no_grad():
            for p in b.params:
                p.add_(0.05)
        assert all(logprob_gap(c, b, lora_path) > 1e-2 for c in clients)  # stale on both until the next sync
        sender.sync(version=2)
        assert all(logprob_gap(c, b, lora_path) < ATOL for c in clients)
    finally:
        sender.close()
        for c in clients:
            c.close()
