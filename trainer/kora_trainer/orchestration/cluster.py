"""Ray for one job: start (or join) the cluster, place the workers with fractional CPUs, tear down.

Locally `python -m kora_trainer.train` starts its own Ray head on 127.0.0.1 with its own temp dir (no
dashboard, nothing listening beyond loopback) and stops it at the end. Under KubeRay the driver runs on
the head pod, where RAY_ADDRESS points at the running cluster: then it joins instead.

Placement: `config/placement.py` makes one placement-group bundle per trainer rank (and per engine of its own);
its `gpu_shares` says how many GPUs each actor asks for inside its bundle (none on a CPU-only
cluster); Ray sets each actor's CUDA_VISIBLE_DEVICES and an engine process inherits its actor's.

CPU fractions only steer placement. Threads are set explicitly, one per process by default: the loop
is sequential (generate, then train, then sync), and on a small shared machine OpenMP's spinning
barriers collapse when a second thread is descheduled — measured on the 2-core box under other load,
the toy's forward+backward took 0.07-0.11 s on 1 thread and 0.3-1.8 s on 2. Pass threads for a quiet
machine with bigger matrices.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kora_trainer.config import ConfigError, TrainerConfig
from kora_trainer.config.layout import engine_gpus
from kora_trainer.config.placement import CPU_SHARES, STRATEGY, Placement, plan_placement
from kora_trainer.config.ray_env import ray_home, single_node_env
from kora_trainer.config.sglang_builds import effective_build, engines_need_api_key, plan_for, same_node_problem
from kora_trainer.orchestration.actor_group import TrainGroup
from kora_trainer.orchestration.multi_lora_workers import AdapterRolloutWorker, MultiLoRAWorker
from kora_trainer.orchestration.workers import EngineWorker, RolloutWorker, TrainWorker, transport_kind
from kora_trainer.wire.engine_auth import ADMIN_API_KEY_ENV, new_admin_key


@dataclass
class Job:
    """Handles to the job's Ray actors (and what to tear down)."""

    trainer: TrainGroup
    rollout: Any
    engines: list[Any]
    engine_urls: list[str]
    transport: str
    pg: Any = None  # the placement group
    info: dict[str, Any] = field(default_factory=dict)


def start_ray(num_cpus: int | None = None) -> tuple[bool, str | None]:
    """Join RAY_ADDRESS's cluster, or start a private local one. Returns (started_here, temp_dir).

    The private head gets config/ray_env.py's single-node environment (loopback only, no usage report,
    no cloud metadata probe). It must be in os.environ before Ray is first imported: Ray reads
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import time, so this is where the driver imports Ray. A joined cluster
    keeps its own environment: the operator sets usage stats in the pods and submissions it builds.
    """
    if "ray" in sys.modules and not os.environ.get("RAY_ADDRESS"):
        from ray._private import ray_constants  # noqa: PLC0415 - Ray loads when a job runs, not on import

        if ray_constants.ENABLE_RAY_CLUSTER:
            raise RuntimeError("Ray was imported before kora_trainer.orchestration.cluster.start_ray set its "
                               "environment: the private head would use the machine's address, not 127.0.0.1")
    if os.environ.get("RAY_ADDRESS"):
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        ray.init(address=os.environ["RAY_ADDRESS"], namespace="kora", log_to_driver=False)
        return False, None
    os.environ.update(single_node_env())
    import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

    # a short path: Ray's unix sockets live under it and a socket path is limited to 107 bytes
    temp_dir = tempfile.mkdtemp(prefix="kora-ray-", dir="/tmp")
    # The head's processes (GCS, raylet, dashboard) inherit the driver's environment when ray.init starts
    # them: they get a HOME holding the bootstrap config, the workers get the user's HOME back.
    real_home = os.environ.get("HOME", str(Path.home()))
    os.environ["HOME"] = str(ray_home(Path(temp_dir) / "home"))
    # Ray 2.60 keeps a generated token in ~/.ray/auth_token, which the workers (the user's HOME) would not find:
    # this head's own token, in the environment every process of it inherits
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    try:
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, _temp_dir=temp_dir,
                 _node_ip_address="127.0.0.1", include_dashboard=False, namespace="kora", log_to_driver=False,
                 configure_logging=False, runtime_env={"env_vars": {"HOME": real_home}})
    finally:
        os.environ["HOME"] = real_home
    return True, temp_dir


@dataclass(frozen=True)
class Placed:
    """The job's placement group, ready, and what its actors are started with."""

    cfg: TrainerConfig
    plan: Placement
    pg: Any
    admin_key: str  # this job's engines' admin routes: only its trainer ranks hold the key
    api_key: str | None  # the same key as the engines' api key, where the build serves a sync route as NORMAL
    kind: str  # the ranks' transport to the engines (workers.transport_kind)

    def bundle(self, i: int) -> Any:
        """The scheduling strategy of an actor in bundle i."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415 - Ray loads when a job runs, not on import

        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)


@dataclass(frozen=True)
class Models:
    """The engines (starting) and the trainer's ranks (set up: rendezvous done, model loaded)."""

    engines: list[Any]  # actor handles as Any: ray types a handle's methods as the plain methods, without .remote
    trainer: TrainGroup
    master: tuple[Any, ...]  # the ranks' rendezvous address
    ranks: list[dict[str, Any]]  # each rank's setup answer (node, device, backend, ...)


def place(cfg: TrainerConfig) -> Placed:
    """The job's placement group (config/placement.py's plan on this cluster's GPUs), once it is ready."""
    import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

    kind = transport_kind(cfg)
    if kind == "colocated" and engine_gpus(cfg) > 1:
        raise ConfigError([f"deployment Colocate with rollout.gpusPerEngine {engine_gpus(cfg)}: an engine spanning "
                           "several trainer ranks' GPUs is planned (kora plan) but not launched yet: set "
                           "rollout.gpusPerEngine to 1, or use deployment.mode Disaggregated"])
    plan = plan_placement(cfg, float(ray.cluster_resources().get("GPU", 0)))
    # this job's engines' admin routes: only its trainer ranks hold the key. Under KubeRay the operator makes the
    # job's key (a per-job Secret, in the pods' environment by secretKeyRef: SPEC "Security"), so that a key
    # lives where Kubernetes guards and deletes secrets, not only in this process; elsewhere one per launch
    admin_key = os.environ.get(ADMIN_API_KEY_ENV) or new_admin_key()
    pg = ray.util.placement_group(plan.bundles, strategy=STRATEGY)
    wait_placed(pg, plan)
    return Placed(cfg, plan, pg, admin_key, admin_key if engines_need_api_key(cfg) else None, kind)


def start_models(placed: Placed, run_dir: Path, threads: int) -> Models:
    """The engines, then the trainer's ranks, which load the model while the engines start."""
    import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

    cfg, plan = placed.cfg, placed.plan
    engine_cls = ray.remote(num_cpus=CPU_SHARES["engine"], num_gpus=plan.shares.engine)(EngineWorker)
    engines: list[Any] = [engine_cls.options(scheduling_strategy=placed.bundle(plan.engine_bundle[i]))
                          .remote(cfg, str(run_dir / "logs"), threads, i, placed.admin_key, placed.api_key)
                          for i in range(cfg.rollout.num_engines)]
    world = len(plan.rank_bundle)
    multi = cfg.multi_lora.on  # the multi-adapter workers (multi_lora_workers.py)
    rank_cls = ray.remote(num_cpus=CPU_SHARES["trainer"], num_gpus=plan.shares.trainer)(
        MultiLoRAWorker if multi else TrainWorker)
    trainer = TrainGroup([rank_cls.options(scheduling_strategy=placed.bundle(plan.rank_bundle[r]))
                          .remote(cfg, threads, r, world) for r in range(world)])
    master = trainer.first("rendezvous")
    ranks = trainer.all("setup", *master)
    return Models(engines, trainer, master, ranks)


def start_rollout(placed: Placed, models: Models) -> Job:
    """The rollout manager on the engines' URLs, then each rank's transport to the engines it feeds."""
    import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

    cfg, plan, engines = placed.cfg, placed.plan, models.engines
    build = effective_build(cfg)
    urls = ray.get([e.url.remote() for e in engines])
    multi = cfg.multi_lora.on
    # generate is no admin route; a multi-adapter job's adapters generate at once (one call each), and its retire
    # aborts an adapter's requests from the rollout manager, which alone knows their rids (an admin route)
    rollout_cls: Any = ray.remote(num_cpus=CPU_SHARES["rollout"])(AdapterRolloutWorker if multi else RolloutWorker)
    rollout = rollout_cls.options(max_concurrency=cfg.multi_lora.slots + 2 if multi else 1).remote(
        cfg, urls, placed.api_key, placed.admin_key if multi else None)
    route_plan = plan_for(cfg)
    if build is not None and route_plan is not None:  # the stock build's in-memory adapter hand-over: one node
        away = same_node_problem(build, route_plan, models.ranks[0]["node"],
                                 ray.get([e.node.remote() for e in engines]))
        if away is not None:
            raise ConfigError([away])
    kinds = ray.get([a.connect.remote([urls[e] for e in plan.engines_of(r)], placed.kind, models.master[0],
                                      placed.admin_key)
                     for r, a in enumerate(models.trainer.actors)])
    world = len(plan.rank_bundle)
    info = {**{k: models.ranks[0][k] for k in ("backend", "device")}, "world": world, "ranks": models.ranks,
            "engine_urls": urls, "gpus_per_trainer": plan.shares.trainer, "gpus_per_engine": plan.shares.engine}
    return Job(models.trainer, rollout, engines, urls, kinds[0], pg=placed.pg, info=info)


def wait_placed(pg: Any, plan: Placement, timeout_s: float = 120.0) -> None:
    """Bounded: a placement group the cluster cannot hold never becomes ready, so say what it asked for."""
    import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"the Ray cluster cannot place the job's {len(plan.bundles)} bundles {plan.bundles} "
                           f"within {timeout_s:.0f}s (cluster resources: {ray.cluster_resources()}): add nodes or "
                           "GPUs, or lower parallelism / rollout.numEngines") from None


def shutdown(job: Job | None, started_ray: bool, temp_dir: str | None) -> None:
    """Stop engines by their own stop() (their pids), then Ray; every wait bounded."""
    import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

    if job is not None:
        # tearing down: keep going past a failed call; an engine whose worker died got SIGTERM with it
        closing = [a.close.remote() for a in job.trainer.actors] + [job.rollout.close.remote()]
        for calls in (closing, [e.stop.remote() for e in job.engines]):
            with contextlib.suppress(Exception):
                ray.get(calls, timeout=30)
        if job.pg is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(job.pg)
    if ray.is_initialized():
        ray.shutdown()
    if started_ray and temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)
