"""Collective delta-skip with two real trainer ranks (two processes in a gloo group) and a real engine.

Rank 1's adapter moves while rank 0's does not: the all-reduced MAX makes BOTH ranks push (rank 0 is the
one that talks to the engine, so a per-rank decision would have skipped the push the policy needed), and
nothing hangs. When neither moves, both skip. Every wait is bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest
import torch

from engine_helpers import start_engine, stop_engine
from kora_trainer.backends.torch_backend import TorchBackend
from kora_trainer.config import load_config
from kora_trainer.sync.delta import DeltaTracker, should_push
from kora_trainer.sync.sender import POLICY_ADAPTER, WeightSender
from kora_trainer.sync.transport import DistributedTransport
from kora_trainer.wire.engine_client import EngineClient
from kora_trainer.wire.group import init_weight_update_group
from kora_trainer.wire.ports import free_port
from tinymodel import make_tiny_model

TIMEOUT_S = 120


def _trainer_rank(rank: int, port: int, model_dir: str, engine_url: str, out: mp.Queue) -> None:
    try:
        torch.set_num_threads(1)
        group = init_weight_update_group("127.0.0.1", port, rank, 2, "trainer_group", "gloo", timeout_s=60)
        cfg, _ = load_config(None, [f"model.path={model_dir}", "data.path=unused.parquet", "lora.rank=4",
                                    "lora.syncMode=Adapter"])
        b = TorchBackend(cfg, device="cpu", threads=1)  # same seed on both ranks: the same adapter
        transport = DistributedTransport.connect([EngineClient(engine_url)]) if rank == 0 else None
        sender = WeightSender(b.model, cfg, transport, trainer_group=group)
        reports = [sender.sync(1)]
        if rank == 1:
            with torch.no_grad():
                b.params[1].add_(0.01)  # only rank 1's shard moved
        reports.append(sender.sync(2))
        reports.append(sender.sync(3))  # nothing moved anywhere
        sender.close()
        out.put((rank, [r.as_dict() for r in reports]))
    except BaseException as e:  # report, never hang the parent
        out.put((rank, f"{type(e).__name__}: {e}"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_two_ranks_that_disagree_still_push(model_dir, tmp_path):
    engine = start_engine(model_dir, tmp_path, "--max-lora-rank", "8")
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_trainer_rank, args=(r, port, str(model_dir), engine.url, out)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            try:
                rank, value = out.get(timeout=TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"a trainer rank hung (> {TIMEOUT_S}s)")
            results[rank] = value
        for p in procs:
            p.join(timeout=30)
        assert all(isinstance(v, list) for v in results.values()), results
        for rank in (0, 1):
            first, disagree, idle = results[rank]
            assert first["pushed"]
            assert disagree["pushed"], f"rank {rank} skipped although rank 1 moved"
            assert disagree["max_delta"] == pytest.approx(0.01, rel=1e-3)  # rank 1's delta, seen by both
            assert not idle["pushed"] and idle["max_delta"] == 0.0
        assert results[0][1]["transport"] == "distributed" and results[0][1]["bytes"] > 0
        assert results[1][1]["bytes"] == 0  # rank 1 decided with rank 0 but does not talk to engines
        with EngineClient(engine.url) as c:  # the engine serves the version pushed at step 2
            out_ = c.generate([[1, 4, 5, 13]], {"max_new_tokens": 1}, lora_path=POLICY_ADAPTER)
            assert out_[0].weight_version == "2"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        stop_engine(engine)


def test_single_rank_decision():
    tracker = DeltaTracker()
    a = [("x", torch.zeros(3))]
    assert should_push(tracker, a, 1e-6) == (True, float("inf"))  # the first sync always pushes
    tracker.mark_pushed(a)
    assert should_push(tracker, [("x", torch.full((3,), 5e-7))], 1e-6) == (False, pytest.approx(5e-7))
    assert should_push(tracker, [("x", torch.tensor([0.0, 2e-6, 0.0]))], 1e-6)[0]
