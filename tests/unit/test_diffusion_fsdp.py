"""FSDP2 over two data-parallel ranks (real torch.distributed gloo processes on CPU) gives the one-rank update.

Both runs start from the same adapter (B moved off zero, so A and B both get gradients), take the same rollout
(the toy's own sampler, seeded) and do two Flow-GRPO optimizer passes (plain SGD: see sgd); the two ranks each
train on half of the prompt groups with the transformer sharded by backends/diffusion/fsdp.py; the one-rank run
trains on all of them in one process. The adapters after must agree to rounding (the order of float sums differs)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from kora_trainer.wire.ports import free_port

PROMPTS, GROUP, STEPS, PASSES = 4, 4, 4, 2
TOLERANCE = 1e-7  # max |a - b| over every A/B element after the passes (measured 3.7e-9; the move is ~1e-3)


def sgd(params):
    """Plain SGD, so the adapters differ exactly as the reduced gradients do. With the job's AdamW (lr 5e-3) they
    differ by up to 2.6e-5 after two passes: Adam's g / sqrt(v) magnifies the rounding of near-zero gradients."""
    return torch.optim.SGD(params, lr=1.0)


def settings():
    from kora_trainer.backends.diffusion.train_loop import FlowGRPOSettings

    return FlowGRPOSettings(prompts_per_step=PROMPTS, samples_per_prompt=GROUP, num_inference_steps=STEPS,
                            lr=5e-3, lora_rank=4, lora_alpha=8.0, seed=5)


def policy(toy_dir):
    """The toy with its adapter, B moved deterministically; the optimizer; the batch's rollout and advantages."""
    from kora_trainer.algorithm import flow_grpo
    from kora_trainer.algorithm.diffusion_rewards import colour_reward
    from kora_trainer.backends.diffusion.train_loop import local_rollout
    from kora_trainer.lora.diffusers import apply_diffusion_lora
    from kora_trainer.lora.model import lora_modules
    from kora_trainer.toys.diffusion import load_diffusion_toy

    torch.set_num_threads(1)
    s = settings()
    toy = load_diffusion_toy(toy_dir)
    toy.transformer.eval()
    torch.manual_seed(s.seed)
    apply_diffusion_lora(toy.transformer, s.lora_rank, s.lora_alpha)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for m in lora_modules(toy.transformer).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.02)
    ids = torch.arange(PROMPTS).repeat_interleave(GROUP)
    traj = local_rollout(s)(toy, ids, 0)
    adv = flow_grpo.advantages(colour_reward(traj.images, toy.targets[ids]), GROUP, s.adv_clip)
    return toy, ids, traj, adv


def rank_main(rank: int, world: int, port: int, toy_dir: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from kora_trainer.algorithm.flow_grpo import Trajectory
    from kora_trainer.backends.diffusion.fsdp import full_adapter, rank_rows, shard_transformer
    from kora_trainer.backends.diffusion.train_loop import update
    from kora_trainer.lora.model import adapter_parameters

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        toy, ids, traj, adv = policy(toy_dir)
        shard_transformer(toy.transformer, init_device_mesh("cpu", (world,)))
        opt = sgd(adapter_parameters(toy.transformer))
        rows = rank_rows(ids.numel(), GROUP, rank, world)
        mine = Trajectory(latents=traj.latents[rows], log_probs=traj.log_probs[rows], timesteps=traj.timesteps,
                          sigmas=traj.sigmas, noise_level=traj.noise_level)
        for _ in range(PASSES):
            update(toy, settings(), mine, ids[rows], adv[rows], opt)
        adapter = full_adapter(toy.transformer)
        if rank == 0:
            torch.save(adapter, out)
    finally:
        dist.destroy_process_group()


def test_two_fsdp2_ranks_give_the_one_rank_update(diffusion_toy_dir, tmp_path):
    from kora_trainer.backends.diffusion.fsdp import full_adapter
    from kora_trainer.backends.diffusion.train_loop import update
    from kora_trainer.lora.model import adapter_parameters

    out = tmp_path / "two_ranks.pt"
    mp.spawn(rank_main, args=(2, free_port(), str(diffusion_toy_dir), str(out)), nprocs=2, join=True)
    toy, ids, traj, adv = policy(diffusion_toy_dir)
    before = full_adapter(toy.transformer)
    opt = sgd(adapter_parameters(toy.transformer))
    for _ in range(PASSES):
        update(toy, settings(), traj, ids, adv, opt)
    one, two = full_adapter(toy.transformer), torch.load(out)
    assert one.keys() == two.keys() and len(one) == 30
    moved = max(float((one[k] - before[k]).abs().max()) for k in one)
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    print(f"largest move of an adapter element {moved:.3g}; largest one-rank vs two-rank difference {diff:.3g}")
    assert moved > 100 * TOLERANCE  # the passes moved the adapter far more than the tolerance
    assert diff < TOLERANCE


def test_a_batch_that_does_not_split_into_whole_groups_per_rank_is_refused():
    from kora_trainer.backends.diffusion.fsdp import rank_rows

    assert rank_rows(16, 4, 1, 2).tolist() == list(range(8, 16))
    with pytest.raises(ValueError, match=r"rolloutBatchSize 3 prompt groups do not split evenly over "
                                         r"parallelism.data 2 ranks"):
        rank_rows(12, 4, 0, 2)


def test_with_several_optimizer_steps_a_rank_takes_its_share_of_each_steps_prompt_groups():
    """4 groups of 4, two optimizer steps (globalBatchSize 8): step k's rows are 8k..8k+7, one group per rank."""
    from kora_trainer.backends.diffusion.fsdp import rank_rows

    assert rank_rows(16, 4, 0, 2, minibatches=2).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert rank_rows(16, 4, 1, 2, minibatches=2).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    with pytest.raises(ValueError, match=r"globalBatchSize 4 samples per optimizer step do not split into whole "
                                         r"prompt groups of 4 over parallelism.data 2 ranks: make globalBatchSize a "
                                         r"multiple of nSamplesPerPrompt x parallelism.data = 8"):
        rank_rows(16, 4, 0, 2, minibatches=4)
