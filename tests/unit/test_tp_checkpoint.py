"""Tensor-parallel checkpoint shards (backends/megatron/tp_checkpoint.py) over a real two-rank gloo group on CPU:
the shards gathered into whole factors and AdamW moments, written once through lora_only.save, and split back
into each rank's own shards bit for bit, with each rank's own RNG stream; a strided shard (a gated linear_fc1's B,
[gate_t; up_t]) goes into the checkpoint in the one-rank layout [gate; up]. (megatron's layers need CUDA; these
parameters carry the attributes megatron's set_tensor_model_parallel_attributes gives a shard.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kora_trainer.backends.megatron.tp_checkpoint import TensorShards, join_shards, shard_split, split_shard
from kora_trainer.wire.ports import free_port

WORLD = 2


def _params(rank: int) -> list[torch.nn.Parameter]:
    """A column-parallel B [8/tp, 4] (rows sharded), a row-parallel A [4, 6/tp] (columns), a replicated A, and a
    gated fc1's B [8/tp, 4] (rows [gate_t; up_t]: stride 2)."""
    torch.manual_seed(100 + rank)  # the shards differ per rank
    b, a, g = (torch.nn.Parameter(torch.randn(*shape)) for shape in ((4, 4), (4, 3), (4, 4)))
    for p, dim in ((b, 0), (a, 1), (g, 0)):
        p.tensor_model_parallel, p.partition_dim = True, dim  # what megatron marks a shard with
    g.partition_stride = 2
    torch.manual_seed(7)
    return [b, a, torch.nn.Parameter(torch.randn(2, 5)), g]


def run_rank(rank: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist

    from kora_trainer.checkpoint import lora_only

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    params = _params(rank)
    opt = torch.optim.AdamW(params, lr=0.1)
    sum(p.sum() * (i + 1) for i, p in enumerate(params)).backward()
    opt.step()
    shards = TensorShards(rank, WORLD, tuple(shard_split(p) for p in params), dist.group.WORLD)
    names = ["b", "a", "r", "g"]
    torch.manual_seed(1000 + rank)
    rng = {**lora_only.capture_rng(), "generators": {}}
    adapter, optimizer, rng = shards.gather(list(zip(names, [p.detach() for p in params], strict=True)),
                                            opt.state_dict(), rng)
    if rank == 0:
        lora_only.save(Path(root), 1, adapter=dict(adapter), optimizer=optimizer, scheduler=None, rng=rng)
    dist.barrier()
    ckpt = lora_only.load_latest(Path(root))
    assert ckpt is not None
    mine, state = shards.local(ckpt.adapter, names, ckpt.optimizer)
    lora_only.restore_rng(shards.own_rng(ckpt.rng))
    torch.save({"params": {n: p.detach().clone() for n, p in zip(names, params, strict=True)}, "mine": mine,
                "moments": [opt.state_dict()["state"][i]["exp_avg"] for i in range(4)],
                "restored": [state["state"][i]["exp_avg"] for i in range(4)], "whole": dict(ckpt.adapter),
                "draw": torch.rand(3)}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_tensor_parallel_shards_round_trip_through_one_checkpoint(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "r.pt")
    mp.spawn(run_rank, args=(free_port(), str(tmp_path / "ckpt"), out), nprocs=WORLD, join=True)
    r0, r1 = (torch.load(f"{out}.{r}", weights_only=False) for r in range(WORLD))
    assert r0["whole"]["b"].shape == (8, 4) and r0["whole"]["a"].shape == (4, 6) and r0["whole"]["r"].shape == (2, 5)
    assert torch.equal(r0["whole"]["b"], torch.cat([r0["params"]["b"], r1["params"]["b"]], 0))
    assert torch.equal(r0["whole"]["a"], torch.cat([r0["params"]["a"], r1["params"]["a"]], 1))
    g0, g1 = r0["params"]["g"], r1["params"]["g"]  # [gate_t; up_t] each: the checkpoint is [gate_0; gate_1; up_0; up_1]
    assert torch.equal(r0["whole"]["g"], torch.cat([g0[:2], g1[:2], g0[2:], g1[2:]], 0))
    for r in (r0, r1):
        for n, p in r["params"].items():
            assert torch.equal(r["mine"][n], p), n  # each rank its own shard back
        for got, want in zip(r["restored"], r["moments"], strict=True):
            assert torch.equal(got, want)  # AdamW's moments split like their parameters
    assert not torch.equal(r0["mine"]["b"], r1["mine"]["b"])
    # each rank continues its own RNG stream (rank r was seeded 1000 + r when the checkpoint was taken)
    for rank, r in enumerate((r0, r1)):
        torch.manual_seed(1000 + rank)
        assert torch.equal(r["draw"], torch.rand(3))


def test_a_shard_that_does_not_divide_is_an_error():
    assert torch.equal(split_shard(torch.arange(6).view(2, 3), None, 1, 2), torch.arange(6).view(2, 3))
    assert split_shard(torch.arange(8).view(4, 2), (0, 1), 1, 2).tolist() == [[4, 5], [6, 7]]
    assert split_shard(torch.arange(8).view(4, 2), (0, 2), 1, 2).tolist() == [[2, 3], [6, 7]]  # [gate_1; up_1]
    whole = torch.arange(16).view(8, 2)
    for stride in (1, 2):
        assert torch.equal(join_shards([split_shard(whole, (0, stride), r, 2) for r in range(2)], (0, stride)), whole)
    with pytest.raises(ValueError, match=r"shape \(3, 2\) does not split into 2 shards on dim 0"):
        split_shard(torch.arange(6).view(3, 2), (0, 1), 0, 2)
