"""Where a job's Ray actors go, as pure functions (no Ray, no torch): the trainer places by them
(`orchestration/cluster.place` makes the placement group), and `kora plan` / `train --dry-run` predict, for a
given set of nodes, each rank's node, GPU and parallel coordinates and each engine's GPUs.

Bundles: one per trainer rank, plus one per engine that has GPUs of its own.
- Colocate (in-memory sync): engine e sits in the bundle of rank e % world, on that rank's GPU (half the GPU for
  the rank, the other half split between the engines beside it) or beside it on a CPU cluster; rank e % world
  feeds it. An engine of gpusPerEngine k > 1 spans the GPUs of ranks e*k .. e*k+k-1 (planned; the trainer does
  not launch it yet, orchestration/cluster.py refuses it at start).
- Disaggregated (or Colocate's distributedEngines): every engine its own bundle with rollout.gpusPerEngine
  GPUs; rank 0 feeds every engine over the weight-update group.
The group's strategy is PACK: Ray fills a node before it takes the next, so adjacent ranks (a tensor-parallel
group: config/layout.py orders ranks tp first) share a node when they fit, and a job that does not fit on one
node spreads over as many as it needs. `assign` predicts that placement by first fit, in bundle order. CPU
fractions only steer placement: threads are set per process (orchestration/cluster.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kora_trainer.config.layout import (
    Coordinates,
    colocated,
    coordinates,
    engine_gpus,
    gpu_demand,
    parallel_problems,
    world_size,
)
from kora_trainer.config.load import ConfigError, read_hf_config
from kora_trainer.config.sections import Engine
from kora_trainer.config.sglang_builds import effective_build, plan_for, same_node_problem
from kora_trainer.config.slot_memory import plan_lines
from kora_trainer.config.start_layout import planned_start_problems
from kora_trainer.config.trainer import TrainerConfig

CPU_SHARES = {"trainer": 0.5, "rollout": 0.1, "engine": 0.2}
STRATEGY = "PACK"


@dataclass(frozen=True)
class GpuShares:
    trainer: float  # per rank
    engine: float  # per engine

    @property
    def total(self) -> float:
        return self.trainer + self.engine


def engines_per_rank(cfg: TrainerConfig) -> int:
    """Colocate: the most engines one rank feeds (engine e sits beside rank e % world)."""
    return max(1, -(-cfg.rollout.num_engines // world_size(cfg.parallelism)))


def colocated_owner(cfg: TrainerConfig, engine: int) -> int:
    """Colocate: the rank engine `engine` sits beside (the first of the gpusPerEngine ranks whose GPUs it spans)."""
    return (engine * max(1, engine_gpus(cfg))) % world_size(cfg.parallelism)


def gpu_shares(cfg: TrainerConfig, cluster_gpus: float) -> GpuShares:
    """Ray `num_gpus` of each trainer rank and each engine inside its bundle (none on a CPU cluster)."""
    per_engine = engine_gpus(cfg)
    if cluster_gpus <= 0:
        if cfg.rollout.engine is Engine.SGLANG or per_engine > 0:
            raise ConfigError([
                f"rollout.gpusPerEngine is {cfg.rollout.gpus_per_engine} but the Ray cluster has no GPU: set "
                "rollout.engine: hf and rollout.gpusPerEngine: 0 to run the reference engine on CPU, or add GPUs"])
        return GpuShares(0.0, 0.0)
    need = gpu_demand(cfg).total
    if need > cluster_gpus:  # the count only: the placement group finds the nodes
        raise ConfigError([f"the job needs {need} GPUs (config/layout.py: parallelism and rollout) and the Ray "
                           f"cluster has {cluster_gpus:g}: add GPUs, or lower parallelism / rollout.numEngines"])
    if colocated(cfg):
        if per_engine > 1:  # the engine spans its ranks' GPUs: handed their devices, it asks Ray for none
            return GpuShares(0.5, 0.0)
        return GpuShares(0.5, 0.5 / engines_per_rank(cfg))
    return GpuShares(1.0, float(per_engine))


@dataclass(frozen=True)
class Placement:
    bundles: list[dict[str, float]]  # Ray placement-group bundles
    rank_bundle: list[int]  # the bundle of each trainer rank
    engine_bundle: list[int]  # the bundle of each engine
    engine_owner: list[int]  # the trainer rank that pushes the policy to each engine
    shares: GpuShares
    colocated: bool

    def engines_of(self, rank: int) -> list[int]:
        return [e for e, owner in enumerate(self.engine_owner) if owner == rank]


def _bundle(cpu: float, gpu: float) -> dict[str, float]:
    return {"CPU": round(cpu, 3), **({"GPU": gpu} if gpu > 0 else {})}


def plan_placement(cfg: TrainerConfig, cluster_gpus: float) -> Placement:
    """The bundles for this job on a cluster with `cluster_gpus` GPUs (0: the CPU path)."""
    world, n = world_size(cfg.parallelism), cfg.rollout.num_engines
    shares = gpu_shares(cfg, cluster_gpus)
    gpu = 1.0 if cluster_gpus > 0 else 0.0
    if colocated(cfg):
        owner = [colocated_owner(cfg, e) for e in range(n)]
        bundles = [_bundle(CPU_SHARES["trainer"] + CPU_SHARES["engine"] * owner.count(r), gpu) for r in range(world)]
        return Placement(bundles, list(range(world)), owner, owner, shares, True)
    bundles = [_bundle(CPU_SHARES["trainer"], gpu) for _ in range(world)]
    bundles += [_bundle(CPU_SHARES["engine"], shares.engine) for _ in range(n)]
    return Placement(bundles, list(range(world)), list(range(world, world + n)), [0] * n, shares, False)


# ---- the prediction: which node and GPUs each bundle gets ------------------------------------------------------

@dataclass(frozen=True)
class Node:
    name: str
    cpus: float
    gpus: int


@dataclass
class _Free:
    node: Node
    cpus: float
    gpus: list[int] = field(default_factory=list)  # free GPU indices on the node


def assign(placement: Placement, nodes: list[Node]) -> list[tuple[str, list[int]]]:
    """(node name, GPU indices) of each bundle, by first fit in bundle order (Ray's PACK fills a node first)."""
    free = [_Free(n, n.cpus, list(range(n.gpus))) for n in nodes]
    out = []
    for i, b in enumerate(placement.bundles):
        need_gpu = int(b.get("GPU", 0))
        slot = next((f for f in free if f.cpus + 1e-9 >= b["CPU"] and len(f.gpus) >= need_gpu), None)
        if slot is None:
            raise ConfigError([f"bundle {i} {b} fits on none of the nodes {[asdict(n) for n in nodes]} once the "
                               "bundles before it are placed: add nodes or GPUs, or lower parallelism / "
                               "rollout.numEngines"])
        slot.cpus -= b["CPU"]
        gpus, slot.gpus = slot.gpus[:need_gpu], slot.gpus[need_gpu:]
        out.append((slot.node.name, gpus))
    return out


@dataclass(frozen=True)
class RankPlan:
    coords: Coordinates
    node: str
    gpus: list[int]
    engines: list[int]  # the engines this rank feeds


@dataclass(frozen=True)
class EnginePlan:
    index: int
    node: str
    gpus: list[int]
    address: str  # what it binds: 127.0.0.1 on a one-node job, the node's address otherwise
    fed_by: int  # the trainer rank pushing to it


@dataclass(frozen=True)
class JobPlan:
    world: int
    ranks: list[RankPlan]
    engines: list[EnginePlan]
    transport: str  # colocated (in memory) | distributed (the weight-update group)
    weight_update_group: list[str]  # its members in rank order (empty when colocated)
    nodes: list[Node]
    sync: str = ""  # which routes carry the policy on the job's SGLang build (config/sglang_builds.py)
    # what the trainer would refuse at start (config/start_layout.py): the plan shows where it would run, and this
    # says that it would not, so a sample that plans is not taken for one that trains
    start_refusals: list[str] = field(default_factory=list)
    slots: list[str] = field(default_factory=list)  # multiLora.maxAdapters auto: the per-slot arithmetic

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        def gpu(g: list[int]) -> str:
            return f"GPU {','.join(map(str, g))}" if g else "CPU"

        out = [f"world {self.world} rank(s) on {len({r.node for r in self.ranks})} node(s); {len(self.engines)} "
               f"engine(s); weights {self.transport}"]
        for r in self.ranks:
            c = r.coords
            out.append(f"  rank {c.rank:>3}  {r.node:<10} {gpu(r.gpus):<8} dp {c.dp} tp {c.tp} pp {c.pp} cp {c.cp} "
                       f"ep {c.ep}" + (f"  feeds engine(s) {r.engines}" if r.engines and self.transport ==
                                       "colocated" else ""))
        for e in self.engines:
            out.append(f"  engine {e.index:>2} {e.node:<10} {gpu(e.gpus):<8} at {e.address}, fed by rank {e.fed_by}")
        if self.weight_update_group:
            out.append(f"  weight-update group ({len(self.weight_update_group)}): "
                       f"{', '.join(self.weight_update_group)}")
        if self.sync:
            out.append(f"  sync: {self.sync}")
        out += [f"  {line}" for line in self.slots]
        out += [f"  REFUSED at start by the trainer: {line}" for line in self.start_refusals]
        return out


def plan_job(cfg: TrainerConfig, nodes: list[Node], check_build: bool = True) -> JobPlan:
    """The whole placement of `cfg` on `nodes`, without starting anything (refused, with `check_build`, where the
    job's SGLang build cannot reach an engine so placed: `build_node_problem`)."""
    if problems := parallel_problems(cfg.parallelism):
        raise ConfigError(problems)
    placement = plan_placement(cfg, sum(n.gpus for n in nodes))
    where = assign(placement, nodes)
    one_node = len({node for node, _ in where}) == 1
    world, span = len(placement.rank_bundle), max(1, engine_gpus(cfg))  # an engine's GPUs = its TP ranks

    def engine_plan(e: int, bundle: int) -> EnginePlan:
        node, gpus = where[bundle]
        owner = placement.engine_owner[e]
        if placement.colocated:  # beside its rank, on the GPUs of the ranks it spans
            gpus = [g for r in range(owner, owner + span) for g in where[placement.rank_bundle[r % world]][1]]
        return EnginePlan(e, node, gpus, "127.0.0.1" if one_node else f"<{node} address>", owner)

    engines = [engine_plan(e, b) for e, b in enumerate(placement.engine_bundle)]
    ranks = [RankPlan(coordinates(cfg.parallelism, r), *where[placement.rank_bundle[r]], placement.engines_of(r))
             for r in range(world)]
    group = [] if placement.colocated else ["trainer rank 0"] + [
        f"engine {e.index} rank {1 + e.index * span + t}" for e in engines for t in range(span)]
    routes = plan_for(cfg)
    sync = routes.note if routes is not None else "kora's routes (the reference engine with its extensions)"
    hf = read_hf_config(cfg.model.path)
    plan = JobPlan(len(ranks), ranks, engines, "colocated" if placement.colocated else "distributed", group, nodes,
                   sync, planned_start_problems(cfg, hf, any(n.gpus for n in nodes)), plan_lines(cfg, hf))
    if check_build and (away := build_node_problem(cfg, plan)):
        raise ConfigError([away])
    return plan


def build_node_problem(cfg: TrainerConfig, plan: JobPlan) -> str | None:
    """The stock build's in-memory adapter hand-over needs every engine on trainer rank 0's node (the trainer
    checks the same at start, on the nodes Ray gave it)."""
    build, routes = effective_build(cfg), plan_for(cfg)
    if build is None or routes is None or routes.refused is not None:
        return None
    return same_node_problem(build, routes, plan.ranks[0].node, [e.node for e in plan.engines])


def parse_nodes(text: str, cpus: float = 64.0) -> list[Node]:
    """`--nodes` as `N` x `G` (e.g. 2x8: two nodes of 8 GPUs each; 1x0: one CPU node)."""
    try:
        count, gpus = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ConfigError([f"--nodes {text!r}: write NODESxGPUS, e.g. 2x8 (two nodes of 8 GPUs) or 1x0"]) from None
    if count < 1 or gpus < 0:
        raise ConfigError([f"--nodes {text!r}: at least one node and no negative GPU count, e.g. 2x8"])
    return [Node(f"node-{i}", cpus, gpus) for i in range(count)]
