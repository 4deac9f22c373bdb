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


# The messages are %-templates, so that the CRD's CEL renders the same words with the same numbers
# (operator/kora_operator/api/rules.py and config/rules.py pass them to CEL's format()).
PARALLEL_MESSAGE = (
    "parallelism.expert %d x expertTensor %d must divide the ranks of one pipeline stage, data %d x tensor %d x "
    "context %d = %d (megatron-core carves expert parallelism out of them): raise parallelism.data to a multiple of "
    "%d, or lower parallelism.expert")
TOTAL_GPUS_MESSAGE = (
    "the job needs %d GPUs (%d trainer ranks = parallelism data x tensor x pipeline x context, %d engines x %d GPUs; "
    "%s) and the cluster has %d (%d %s): raise resources.workers or resources.gpusPerWorker, or lower parallelism / "
    "rollout.numEngines")
COLOCATE_TOTAL = "max(ranks, gpusPerEngine): Colocate, the engines share the ranks' GPUs"
DISAGGREGATED_TOTAL = "ranks + engines x gpusPerEngine: Disaggregated"
NODE_GPUS_MESSAGE = (
    "parallelism.tensor %d and rollout.gpusPerEngine %d must each fit on one node, the largest has %d GPUs: raise "
    "resources.gpusPerWorker to %d, or lower them")


def parallel_problems(p: ParallelismSpec) -> list[str]:
    """What makes these sizes impossible for megatron-core's layout (empty: they fit)."""
    stage = world_size(p) // p.pipeline
    if stage % (p.expert * p.expert_tensor):
        return [PARALLEL_MESSAGE % (p.expert, p.expert_tensor, p.data, p.tensor, p.context, stage, fix_data(p))]
    return []


FIX_DATA_SEARCH = 256  # CEL has no loop: the CRD searches data 1..256 too (config/rules.py)


def fix_data(p: ParallelismSpec) -> int:
    """The smallest data size that makes expert x expertTensor divide data x tensor x context, looked for up to
    FIX_DATA_SEARCH; past that, expert x expertTensor itself (always a fix, not always the smallest)."""
    need = p.expert * p.expert_tensor
    return next((d for d in range(1, FIX_DATA_SEARCH + 1) if (d * p.tensor * p.context) % need == 0), need)


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


def total_gpus_problem(cfg: TrainerConfig, gpus_per_node: list[int]) -> str | None:
    """Do the nodes have as many GPUs as the job needs in all?"""
    d = gpu_demand(cfg)
    have = sum(gpus_per_node)
    if d.total <= have:
        return None
    nodes = len(gpus_per_node)
    return TOTAL_GPUS_MESSAGE % (d.total, d.ranks, cfg.rollout.num_engines, engine_gpus(cfg),
                                 COLOCATE_TOTAL if colocated(cfg) else DISAGGREGATED_TOTAL, have, nodes,
                                 "node" if nodes == 1 else "nodes")


def node_gpus_problem(cfg: TrainerConfig, gpus_per_node: list[int]) -> str | None:
    """Does the largest group that must sit on one node (a TP group, one engine) fit on the largest node?"""
    d = gpu_demand(cfg)
    biggest = max(gpus_per_node, default=0)
    if d.largest_group <= biggest:
        return None
    return NODE_GPUS_MESSAGE % (cfg.parallelism.tensor, engine_gpus(cfg), biggest, d.largest_group)

