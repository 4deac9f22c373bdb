"""A diffusion job's data-parallel ranks (parallelism.data > 1) as Ray actors, one `DiffusionRankWorker` each.

As the language-model ranks (workers.TrainWorker): rank 0 finds its node's address and a port there
(`rendezvous`), then every rank joins the trainer's own gloo group there at once (`setup`: torch's default group
in each actor's process, the store and gloo bound to the route towards rank 0: loopback on one node). Each rank
holds the transformer FSDP2-sharded over the ranks (backends/diffusion/fsdp.py) and its AdamW's shard; the driver keeps
the engine and the rollouts and hands each rank its rows (fsdp.rank_rows) through the object store.

A sync, a checkpoint and the export gather the adapter whole on every rank (fsdp.full_adapter: the all-gather is
a collective), and rank 0 alone pushes or writes. Rank 0 pushes from an unsharded copy of the adapted transformer
it keeps for that (the sync classes fold or pack from a plain module: wire/diffusion_client.py), and it is
placed on the driver's node, the engine's: the push hands same-host handles over.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kora_trainer.backends.diffusion.actor import DiffusionPolicy, adapted, export, load_model, make_sync, settings_of
from kora_trainer.backends.diffusion.fsdp import load_full_adapter, rank_rows
from kora_trainer.config.placement import CPU_SHARES
from kora_trainer.orchestration.actor_group import TrainGroup
from kora_trainer.orchestration.workers import rendezvous_address
from kora_trainer.wire.group import init_default_group

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from kora_trainer.backends.diffusion.actor import Batch, DiffusionPolicy
    from kora_trainer.config import TrainerConfig
    from kora_trainer.toys.diffusion import DiffusionToy
    from kora_trainer.wire.diffusion_client import Pushed


class DiffusionRankWorker:
    """One data-parallel rank: `rendezvous()` on rank 0, then `setup()` on every rank at once (it builds `policy`)."""

    policy: DiffusionPolicy

    def __init__(self, cfg: TrainerConfig, threads: int, rank: int, world: int):
        self.cfg, self.threads, self.rank, self.world = cfg, threads, rank, world
        self.mirror: DiffusionToy | None = None  # rank 0: the unsharded copy it pushes and exports from
        self.push: Any = None

    def rendezvous(self) -> tuple[str, int]:
        return rendezvous_address()

    def setup(self, master_address: str, master_port: int, engine_url: str) -> dict[str, Any]:
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        torch.set_num_threads(self.threads)
        init_default_group(master_address, master_port, self.rank, self.world)
        mesh = init_device_mesh("cpu", (self.world,))
        self.policy = DiffusionPolicy(self.cfg, load_model(self.cfg), mesh, self.rank)
        if self.rank == 0:
            self.mirror = adapted(self.cfg, load_model(self.cfg))
            self.push = make_sync(self.cfg, engine_url)
        return {"rank": self.rank, "device": "cpu", "node": ray.get_runtime_context().get_node_id(),
                "address": ray.util.get_node_ip_address()}

    def train(self, step: int, batch: Batch) -> list[dict[str, float]]:
        return self.policy.train(step, batch)

    def _mirrored(self) -> torch.nn.Module | None:
        """The adapter gathered whole (every rank) into rank 0's unsharded copy; that copy's transformer on rank 0,
        None on the others."""
        full = self.policy.adapter()
        if self.mirror is None:
            return None
        load_full_adapter(self.mirror.transformer, full)
        module: torch.nn.Module = self.mirror.transformer
        return module

    def sync(self) -> Pushed | None:
        module = self._mirrored()
        return None if module is None else self.push(module)

    def save(self, root: str, step: int) -> str | None:
        path = self.policy.save(root, step)
        return None if path is None else str(path)

    def resume(self, root: str) -> dict[str, Any] | None:
        return self.policy.resume(root)

    def export(self, root: str, step: int) -> str | None:
        module = self._mirrored()
        return None if module is None else str(export(self.cfg, root, step, module))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class DiffusionRanks:
    """The driver's face of the ranks, as the one-process path's LocalPolicy (recipes/flow_grpo.py): train, sync,
    save, resume, export."""

    def __init__(self, cfg: TrainerConfig, engine_url: str, threads: int):
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415 - Ray loads when a job runs, not on import

        world = cfg.parallelism.data
        here = ray.get_runtime_context().get_node_id()  # the driver's node, where the engine runs
        cls = ray.remote(num_cpus=CPU_SHARES["trainer"])(DiffusionRankWorker)
        # actor handles as Any: ray types a handle's methods as the plain methods, without their .remote
        self.group = TrainGroup([
            cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False) if r == 0 else "DEFAULT")
            .remote(cfg, threads, r, world) for r in range(world)])
        self.cfg, self.world = cfg, world
        master = self.group.first("rendezvous")
        self.ranks = self.group.all("setup", *master, engine_url)

    def train(self, step: int, batch: Batch) -> list[list[dict[str, float]]]:
        """Each rank its rows (its share of each minibatch's prompt groups); every rank's pass stats, rank order."""
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        s = settings_of(self.cfg)
        shares = [ray.put(batch.rows(rank_rows(batch.ids.numel(), s.samples_per_prompt, r, self.world,
                                               s.minibatches))) for r in range(self.world)]
        answers: list[list[dict[str, float]]] = ray.get([a.train.remote(step, share)
                                                          for a, share in zip(self.group.actors, shares, strict=True)])
        return answers

    def sync(self) -> Pushed:
        pushed: Pushed = self.group.written("sync")
        return pushed

    def save(self, root: str, step: int) -> Path:
        return Path(self.group.written("save", root, step))

    def resume(self, root: str) -> dict[str, Any] | None:
        info: dict[str, Any] | None = self.group.all("resume", root)[0]  # every rank restores the same state
        return info

    def export(self, root: str, step: int) -> Path:
        return Path(self.group.written("export", root, step))

    def close(self) -> None:
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        with contextlib.suppress(Exception):  # tearing down: keep going past a rank that died
            ray.get([a.close.remote() for a in self.group.actors], timeout=30)
        for a in self.group.actors:
            ray.kill(a)
