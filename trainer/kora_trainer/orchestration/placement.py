"""Where a job's Ray actors go: one placement-group bundle per trainer rank (and per engine of its own), as a pure
function of the config and the cluster's GPU count; `cluster.launch` makes the group and places the actors.

- Colocate (in-memory sync): engine e sits in the bundle of rank e % world, on that rank's GPU (the GPU fractions
  of backends/select.gpu_shares) or beside it on a CPU cluster; rank e % world feeds it.
- Disaggregated (or Colocate's distributedEngines): every engine its own bundle with rollout.gpusPerEngine GPUs;
  rank 0 feeds every engine over the weight-update group.

The group's strategy is PACK: Ray fills a node before it takes the next, so adjacent ranks (a tensor-parallel
group: config/layout.py orders ranks tp first) share a node when they fit, and a job that does not fit on one
node spreads over as many as it needs (what the two-node test shows). CPU fractions only steer placement: threads
are set per process (cluster.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kora_trainer.backends.select import GpuShares, gpu_shares
from kora_trainer.config import TrainerConfig
from kora_trainer.config.layout import colocated, world_size

CPU_SHARES = {"trainer": 0.5, "rollout": 0.1, "engine": 0.2}
STRATEGY = "PACK"


@dataclass(frozen=True)
class Placement:
    bundles: list[dict[str, float]]  # Ray placement-group bundles
    rank_bundle: list[int]  # the bundle of each trainer rank
    engine_bundle: list[int]  # the bundle of each engine
    engine_owner: list[int]  # the trainer rank that pushes the policy to each engine
    shares: GpuShares  # num_gpus of each rank / engine actor inside its bundle
    colocated: bool

    def engines_of(self, rank: int) -> list[int]:
        return [e for e, owner in enumerate(self.engine_owner) if owner == rank]


def _bundle(cpu: float, gpu: float) -> dict[str, float]:
    return {"CPU": round(cpu, 3), **({"GPU": gpu} if gpu > 0 else {})}


def plan_placement(cfg: TrainerConfig, cluster_gpus: float) -> Placement:
    """The bundles for this job on a cluster with `cluster_gpus` GPUs (0: the CPU path)."""
    world, n = world_size(cfg.parallelism), cfg.rollout.num_engines
    together = colocated(cfg)
    shares = gpu_shares(cfg, cluster_gpus)
    gpu = 1.0 if cluster_gpus > 0 else 0.0
    if together:
        owner = [e % world for e in range(n)]
        bundles = [_bundle(CPU_SHARES["trainer"] + CPU_SHARES["engine"] * owner.count(r), gpu) for r in range(world)]
        return Placement(bundles, list(range(world)), owner, owner, shares, True)
    bundles = [_bundle(CPU_SHARES["trainer"], gpu) for _ in range(world)]
    bundles += [_bundle(CPU_SHARES["engine"], shares.engine) for _ in range(n)]
    return Placement(bundles, list(range(world)), list(range(world, world + n)), [0] * n, shares, False)
