"""Checkpoints and the HF-PEFT export of the megatron policy under tensor parallelism 2 (checkpoint/training.py with
backends/megatron/tp_checkpoint.py): every rank calls save / export (the shards are gathered), rank 0 alone writes,
and a fresh TP = 2 policy restored from the checkpoint continues exactly as the uninterrupted one; the checkpoint
holds the whole factors in the one-rank layout (a gated linear_fc1's B: the ranks' gate halves, then their up
halves), so a TP = 1 job resumes it with the same adapter.

Two ways to run the two ranks: one GPU each over NCCL (2 GPUs), or both on cuda:0 over gloo (one GPU: NCCL refuses
two ranks of one group on one device), so the TP code paths run on a one-GPU machine too.
Run: PYTHONPATH=$PWD/trainer:$PWD/engine:$PWD/tests:/path/to/megatron-core \
    pytest -m gpu tests/gpu/test_megatron_tp_checkpoint.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_megatron_model import PROMPT, RESPONSES, REWARDS, TARGETS, _cfg, random_hf_adapter

from gpukit import megatron_marks
from kora_trainer.wire.ports import free_port
from tinymodel import make_tiny_model

TP = 2
LAYOUTS = [pytest.param(False, id="nccl-gpu-per-rank", marks=megatron_marks(gpus=2)),
           pytest.param(True, id="gloo-one-gpu", marks=megatron_marks(gpus=1))]


def _policy(model_dir: Path, tensor: int):
    from kora_trainer.backends.megatron.backend import MegatronBackend
    from kora_trainer.backends.megatron.export import load_hf_adapter

    mg = MegatronBackend(_cfg(model_dir, TARGETS, tensor), dtype=torch.float32)
    load_hf_adapter(mg.model, random_hf_adapter(mg.layout, mg.hf_config, TARGETS, std=0.05), mg.layout)
    return mg


def _step(mg) -> float:
    from kora_trainer.backends.batch import RolloutBatch

    prompts = [PROMPT] * len(RESPONSES)
    old = mg.logprobs(prompts, RESPONSES)
    return float(mg.train_step(RolloutBatch(prompts, RESPONSES, old, REWARDS, group_size=4)).loss)


def _shards(mg) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in mg.adapter_named()}


def run_rank(rank: int, world: int, port: int, model_dir: str, root: str, out: str, share_gpu: bool) -> None:
    """Two steps, a checkpoint, a third step; then a fresh policy restored from the checkpoint takes the third
    step again. Every rank saves what it saw under out.<rank>."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from kora_trainer.backends.megatron.parallel import destroy_parallel, init_parallel
    from kora_trainer.backends.megatron.tp_checkpoint import shard_split
    from kora_trainer.checkpoint.training import export_adapter, restore_training_state, save_training_state

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.set_device(0 if share_gpu else rank)
    init_parallel(world, backend="gloo" if share_gpu else "nccl")
    straight = _policy(Path(model_dir), TP)
    losses = [_step(straight) for _ in range(2)]
    saved = save_training_state(Path(root), straight, data_position=2, keep=2, meta={"sync_mode": "Merge"})
    exported = export_adapter(Path(root), straight, straight.cfg, {"seed": 0})
    after_save = _shards(straight)
    splits = {n: shard_split(p) for (n, _), p in zip(straight.adapter_named(), straight.params, strict=True)}
    third = _step(straight)
    want = _shards(straight)
    del straight
    resumed = _policy(Path(model_dir), TP)  # a different random adapter until the checkpoint is restored
    info = restore_training_state(Path(root), resumed)
    restored = _shards(resumed)
    again = _step(resumed)
    torch.save({"losses": losses, "saved": None if saved is None else str(saved),
                "exported": None if exported is None else str(exported), "after_save": after_save,
                "restored": restored, "third": third, "again": again, "want": want, "got": _shards(resumed),
                "splits": splits,
                "info": None if info is None else info.as_dict()}, f"{out}.{rank}")
    destroy_parallel()


@pytest.mark.parametrize("share_gpu", LAYOUTS)
def test_a_tensor_parallel_checkpoint_resumes_exactly_and_is_written_once(tmp_path, share_gpu):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file


    model_dir = make_tiny_model(tmp_path / "tiny")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    root, out = tmp_path / "ckpt", str(tmp_path / "tp.pt")
    mp.spawn(run_rank, args=(TP, free_port(), str(model_dir), str(root), out, share_gpu), nprocs=TP, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(TP)]
    assert ranks[0]["saved"] and ranks[1]["saved"] is None  # rank 0 wrote, rank 1 only gathered
    assert ranks[0]["exported"] and ranks[1]["exported"] is None
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002"]
    for r in ranks:
        assert r["info"]["step"] == 2
        assert any(not torch.equal(r["want"][n], t) for n, t in r["after_save"].items())  # step 3 moved it
        for n, t in r["after_save"].items():  # each rank got its own shards back, bit for bit
            assert torch.equal(r["restored"][n], t), n
        assert r["again"] == r["third"]  # the resumed step is the uninterrupted one
        for n, t in r["want"].items():
            assert torch.equal(r["got"][n], t), n
    # the two ranks' shards differ (the checkpoint split them, it did not hand both rank 0's)
    assert any(not torch.equal(ranks[0]["after_save"][n], ranks[1]["after_save"][n]) for n in ranks[0]["after_save"])
    # the checkpoint holds whole factors in the one-rank layout: each rank's shard is its split of it
    from kora_trainer.backends.megatron.tp_checkpoint import split_shard

    whole = load_file(str(root / "step_00000002" / "adapter.safetensors"))
    assert any(split is not None and split[1] == 2 for split in ranks[0]["splits"].values())  # a gated fc1's B
    for n, t0 in ranks[0]["after_save"].items():
        t1 = ranks[1]["after_save"][n]
        if t0.shape == whole[n].shape:
            assert torch.equal(t0, whole[n]) and torch.equal(t1, whole[n])  # replicated
        else:
            split = ranks[0]["splits"][n]
            assert torch.equal(split_shard(whole[n], split, 0, TP), t0), n
            assert torch.equal(split_shard(whole[n], split, 1, TP), t1), n
    exported = load_file(str(Path(ranks[0]["exported"]) / "adapter_model.safetensors"))
    assert exported and all(".lora_A." in k or ".lora_B." in k for k in exported)
    # a TP = 1 job resumes the TP = 2 checkpoint: the same step, the whole adapter
    from kora_trainer.backends.megatron.parallel import destroy_parallel, init_parallel
    from kora_trainer.checkpoint.training import restore_training_state

    os.environ["MASTER_PORT"] = str(free_port())
    init_parallel(1)
    try:
        one = _policy(model_dir, 1)
        assert restore_training_state(root, one).step == 2
        for n, t in one.adapter_named():
            assert torch.equal(t.detach().cpu(), whole[n]), n
    finally:
        destroy_parallel()
