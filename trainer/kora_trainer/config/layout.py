"""How many trainer ranks and GPUs a job needs, and each rank's parallel coordinates: pure functions of the
config, shared by the trainer (its Ray placement), `kora plan` and the operator (sizing a RayJob's workers).

The trainer's world is data x tensor x pipeline x context ranks, one process each (megatron-core's rank order
tp-cp-dp-pp: tensor-parallel neighbours are adjacent ranks, so a TP group fits on one node). Expert parallelism is
carved out of the same ranks as megatron-core does: within a pipeline stage the world/pipeline ranks regroup as
expertTensor x expert x expert-data, so expert x expertTensor must divide world / pipeline.

GPUs (a GPU cluster):
- Disaggregated: every rank has a GPU and every engine rollout.gpusPerEngine of its own: world + engines x
  gpusPerEngine.
- Colocate: the engines share the ranks' GPUs: engine e sits on the GPU of rank e % world (spanning
  gpusPerEngine adjacent ranks' GPUs when it needs more than one), several engines per GPU when there are more
  engines than GPUs: max(world, gpusPerEngine). (Colocate with rollout.distributedEngines > 0 feeds its engines
  over the weight-update group: they count as Disaggregated.)
"""

from __future__ import annotations

from dataclasses import dataclass

from kora_trainer.config.sections import DeploymentMode, Engine, ParallelismSpec
from kora_trainer.config.trainer import TrainerConfig


@dataclass(frozen=True)
class Coordinates:
    """One rank's place in each parallel group (megatron-core's names)."""

    rank: int
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    edp: int  # expert-data-parallel index (the ranks holding the same experts)


def world_size(p: ParallelismSpec) -> int:
    return p.data * p.tensor * p.pipeline * p.context


def parallel_problems(p: ParallelismSpec) -> list[str]:
    """What makes these sizes impossible for megatron-core's layout (empty: they fit)."""
    stage = world_size(p) // p.pipeline
    if stage % (p.expert * p.expert_tensor):
        return [f"parallelism.expert {p.expert} x expertTensor {p.expert_tensor} must divide the ranks of one "
                f"pipeline stage, data {p.data} x tensor {p.tensor} x context {p.context} = {stage} (megatron-core "
                f"carves expert parallelism out of them): raise parallelism.data to a multiple of "
                f"{_fix_data(p)}, or lower parallelism.expert"]
    return []


def _fix_data(p: ParallelismSpec) -> int:
    need = p.expert * p.expert_tensor
    d = 1
    while (d * p.tensor * p.context) % need:
        d += 1
    return d


def coordinates(p: ParallelismSpec, rank: int) -> Coordinates:
    """Rank `rank`'s coordinates in megatron-core's default order (tp fastest, then cp, dp, pp)."""
    tp = rank % p.tensor
    cp = (rank // p.tensor) % p.context
    dp = (rank // (p.tensor * p.context)) % p.data
    pp = rank // (p.tensor * p.context * p.data)
    local = rank % (world_size(p) // p.pipeline)  # the rank within its pipeline stage
    ep = (local // p.expert_tensor) % p.expert
    edp = local // (p.expert_tensor * p.expert)
    return Coordinates(rank, dp, tp, pp, cp, ep, edp)


def engine_gpus(cfg: TrainerConfig) -> int:
    """GPUs one engine uses (the reference engine uses at most one device)."""
    per = cfg.rollout.gpus_per_engine
    return per if cfg.rollout.engine is Engine.SGLANG else min(per, 1)


def colocated(cfg: TrainerConfig) -> bool:
    """Colocate with in-memory sync: the engines share the ranks' GPUs (Colocate's distributedEngines get
    the weight-update group and GPUs of their own)."""
    return cfg.deployment.mode is DeploymentMode.COLOCATE and cfg.rollout.distributed_engines == 0


@dataclass(frozen=True)
class GpuDemand:
    ranks: int  # trainer processes
    trainer_gpus: int  # GPUs the ranks hold (one each)
    engine_gpus: int  # GPUs the engines use in all (shared with the ranks when colocated)
    total: int  # GPUs the job needs
    largest_group: int  # GPUs that must sit on one node (a TP group, or one engine)


def gpu_demand(cfg: TrainerConfig) -> GpuDemand:
    """What the job needs of a GPU cluster (see the module docstring)."""
    ranks = world_size(cfg.parallelism)
    per_engine = engine_gpus(cfg)
    engines = cfg.rollout.num_engines * per_engine
    total = max(ranks, per_engine) if colocated(cfg) else ranks + engines
    return GpuDemand(ranks, ranks, engines, total, max(cfg.parallelism.tensor, per_engine))


def fit_problems(cfg: TrainerConfig, gpus_per_node: list[int]) -> list[str]:
    """Does the job fit nodes with these GPU counts? (The CPU path, a cluster without GPUs, is not checked
    here: backends/select.gpu_shares refuses engines that ask for GPUs there.)"""
    d = gpu_demand(cfg)
    have, biggest = sum(gpus_per_node), max(gpus_per_node, default=0)
    problems = []
    if d.total > have:
        how = ("max(ranks, gpusPerEngine): Colocate, the engines share the ranks' GPUs" if colocated(cfg)
               else "ranks + engines x gpusPerEngine: Disaggregated")
        problems.append(
            f"the job needs {d.total} GPUs ({d.ranks} trainer ranks = parallelism data x tensor x pipeline x context, "
            f"{cfg.rollout.num_engines} engines x {engine_gpus(cfg)} GPUs; {how}) and the cluster has {have} "
            f"({len(gpus_per_node)} nodes): raise resources.workers or resources.gpusPerWorker, or lower "
            "parallelism / rollout.numEngines")
    if d.largest_group > biggest:
        problems.append(
            f"parallelism.tensor {cfg.parallelism.tensor} and rollout.gpusPerEngine {engine_gpus(cfg)} must each "
            f"fit on one node, the largest has {biggest} GPUs: raise resources.gpusPerWorker to {d.largest_group}, "
            "or lower them")
    return problems
