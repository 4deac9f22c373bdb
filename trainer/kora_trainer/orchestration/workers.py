"""The job's three kinds of worker, as plain classes; `cluster.py` turns them into Ray actors.

- TrainWorker: the training actor (policy + optimizer; torch or megatron backend) and the weight sender
  (rank 0 of the weight-update group; the fast path where it applies, sync/fast/path.py).
- EngineWorker: starts one engine process from the launcher's command line and stops it.
- RolloutWorker: the rollout manager (prompts -> engines -> scored samples).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kora_trainer import heap
from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.backends.data_parallel import RankContext
from kora_trainer.backends.grpo_step import StepMetrics
from kora_trainer.backends.select import PolicyBackend, make_backend
from kora_trainer.checkpoint.precision import torch_dtype
from kora_trainer.checkpoint.training import export_adapter, restore_training_state, save_training_state
from kora_trainer.config import DeploymentMode, TrainerConfig
from kora_trainer.orchestration.addresses import node_address
from kora_trainer.orchestration.engine_watch import EngineStatus, HangWatch
from kora_trainer.orchestration.engines import EngineProcess
from kora_trainer.orchestration.rollout_manager import Rollout
from kora_trainer.sync.sender import SyncReport
from kora_trainer.sync.transport import ColocatedTransport, DistributedTransport
from kora_trainer.wire.engine_client import EngineClient
from kora_trainer.wire.ports import free_port


def transport_kind(cfg: TrainerConfig) -> str:
    """Colocate feeds engines in memory; Disaggregated (or Colocate's distributedEngines) over the group."""
    if cfg.deployment.mode is DeploymentMode.COLOCATE and cfg.rollout.distributed_engines == 0:
        return "colocated"
    return "distributed"


def rendezvous_address() -> tuple[str, int]:
    """Rank 0's: this node's address (127.0.0.1 on a one-node cluster) and a port free on it, where the trainer
    ranks' process group meets."""
    host = node_address()
    return host, free_port(host)


class TrainWorker:
    """One trainer rank. Made in two steps, so that rank 0's node address and port (where the ranks' process
    group meets) are known before any rank builds its backend: `rendezvous()` on rank 0, then `setup()` on every
    rank at once."""

    def __init__(self, cfg: TrainerConfig, threads: int | None = None, rank: int = 0, world: int = 1):
        self.cfg, self.threads, self.rank, self.world = cfg, threads, rank, world
        self._backend: PolicyBackend | None = None
        self.sender: Any = None

    @property
    def backend(self) -> PolicyBackend:
        if self._backend is None:
            raise RuntimeError("TrainWorker.setup() builds the backend: call it first")
        return self._backend

    def rendezvous(self) -> tuple[str, int]:
        return rendezvous_address()

    def setup(self, master_address: str, master_port: int) -> dict[str, Any]:
        """Join the trainer's process group and build the backend (torch or megatron: backends/select.py);
        returns where this rank runs (the driver prints rank 0's, `kora plan` predicts them)."""
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        ctx = RankContext(self.rank, self.world, master_address, master_port)
        self._backend = make_backend(self.cfg, threads=self.threads, rank=ctx if self.world > 1 else None)
        context = ray.get_runtime_context()
        return {"rank": self.rank, "backend": type(self.backend).__name__, "device": str(self.backend.device),
                "node": context.get_node_id(), "address": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def connect(self, engine_urls: list[str], kind: str, host: str = "127.0.0.1",
                admin_api_key: str | None = None) -> str:
        """This rank's transport to the engines it feeds: Disaggregated, rank 0 makes the weight-update group on
        `host` (its node address when engines run on other nodes) with every engine; Colocate, each rank hands its
        own engines the policy in memory. A rank with no engine sends nothing (it still takes part in the
        collective delta-skip decision). `admin_api_key`: the job's engine admin key (every sync route is admin)."""
        clients = [EngineClient(u, admin_api_key=admin_api_key) for u in engine_urls]
        transport: DistributedTransport | ColocatedTransport | None = None
        if clients and kind == "distributed":
            backend = "nccl" if self.backend.device.type == "cuda" and torch.distributed.is_nccl_available() else "gloo"
            transport = DistributedTransport.connect(clients, backend=backend, host=host)
        elif clients:
            transport = ColocatedTransport(clients)
        from kora_trainer.sync.fast.path import with_fast_path  # noqa: PLC0415 - the fast path loads Triton: not on the driver

        self.sender = with_fast_path(self.backend.make_sender(transport), self.cfg)  # sync/fast/path.py
        heap.freeze(f"trainer rank {self.rank}")  # the backend and the sender: out of every later full collection
        return transport.kind if transport is not None else "none"

    def sync(self) -> SyncReport:
        report: SyncReport = self.sender.sync(self.backend.version)  # a dataclass through Ray, not a dict
        return report

    def train_step(self, batch: RolloutBatch) -> StepMetrics:
        metrics = self.backend.train_step(batch)
        if self.sender is not None:
            self.sender.arm()  # the push comes next (sync/sender.py)
        return metrics

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        return self.backend.logprobs(prompts, responses)

    # ---- checkpoints (checkpoint/training.py says what they hold and what resuming reproduces) ----------

    def check_lora_only(self) -> None:
        self.backend.check_lora_only()

    def resume(self, root: str) -> dict[str, Any] | None:
        """Restore the newest good checkpoint under root (adapter, optimizer, RNG, version)."""
        resumed = restore_training_state(Path(root), self.backend)
        return resumed.as_dict() if resumed is not None else None

    def save_checkpoint(self, root: str, data_position: int, keep: int, meta: dict[str, Any]) -> str | None:
        """On every rank (TP shards are gathered); the path on the rank that wrote it, None on the others."""
        path = save_training_state(Path(root), self.backend, data_position=data_position, keep=keep, meta=meta,
                                   dtype=torch_dtype(self.cfg.checkpoint.dtype))
        return str(path) if path is not None else None

    def export_hf(self, root: str, meta: dict[str, Any]) -> str | None:
        path = export_adapter(Path(root), self.backend, self.cfg, meta)
        return str(path) if path is not None else None

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class EngineWorker:
    def __init__(self, cfg: TrainerConfig, log_dir: str, threads: int | None, index: int,
                 admin_api_key: str | None = None, api_key: str | None = None):
        # bound where the job's other nodes reach it (loopback on a one-node cluster); admin routes need the key
        self.engine = EngineProcess.start(cfg, Path(log_dir), threads=threads, index=index, host=node_address(),
                                          admin_api_key=admin_api_key, api_key=api_key)
        # a hung engine (stopped, or wedged with its sockets open) is killed after engineHangSeconds, so the call
        # in flight fails at once instead of waiting out its own timeout (engine_watch.py)
        self.watch = HangWatch(self.engine.proc, self.engine.url, cfg.rollout.engine_hang_seconds)

    def node(self) -> str:
        """The Ray node this engine runs on (an SGLang build's in-memory hand-over needs trainer rank 0's)."""
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        return str(ray.get_runtime_context().get_node_id())

    def url(self) -> str:
        return self.engine.url

    def pid(self) -> int:
        return int(self.engine.proc.pid)

    def status(self, settle_s: float = 0.0) -> EngineStatus:
        """The engine's exit code (None while it runs), pid, log, and whether its HangWatch killed it as hung, after
        waiting up to `settle_s` for the watch's word: engine_watch.py asks after a failure."""
        self.watch.settle(settle_s)
        return EngineStatus(self.engine.proc.poll(), int(self.engine.proc.pid), str(self.engine.log_path),
                            self.watch.hung)

    def stop(self) -> None:
        self.watch.stop()
        self.engine.stop()


class RolloutWorker:
    def __init__(self, cfg: TrainerConfig, engine_urls: list[str], api_key: str | None = None,
                 admin_api_key: str | None = None, calls_per_engine: int | None = None):
        # /generate needs the api key where the engines have one; the admin key only a multi-adapter job's rollout
        # manager gets, for the /abort_request of a retiring adapter's requests (AdapterRolloutWorker.abort_adapter)
        self.rollout = Rollout(cfg, engine_urls, api_key=api_key, admin_api_key=admin_api_key,
                               calls_per_engine=calls_per_engine)
        heap.freeze("the rollout worker")  # its imports: out of every later full collection (heap.py)

    def generate(self, step: int) -> tuple[RolloutBatch, dict[str, Any]]:
        return self.rollout.generate(step)

    def skip_to(self, position: int) -> int:
        return self.rollout.skip_to(position)

    def close(self) -> None:
        self.rollout.close()
