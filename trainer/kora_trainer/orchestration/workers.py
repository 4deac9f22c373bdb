"""The job's three kinds of worker, as plain classes; `cluster.py` turns them into Ray actors.

- TrainWorker: the training actor (policy + optimizer; torch or megatron backend) and the weight sender
  (rank 0 of the weight-update group; the fast path where it applies, sync/fast_sender.py).
- EngineWorker: starts one engine process from the launcher's command line and stops it.
- RolloutWorker: the rollout manager (prompts -> engines -> scored samples).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.backends.grpo_step import StepMetrics
from kora_trainer.config import DeploymentMode, TrainerConfig
from kora_trainer.orchestration.engines import EngineProcess
from kora_trainer.orchestration.rollout_manager import Rollout
from kora_trainer.sync.sender import SyncReport


def transport_kind(cfg: TrainerConfig) -> str:
    """Colocate feeds engines in memory; Disaggregated (or Colocate's distributedEngines) over the group."""
    if cfg.deployment.mode is DeploymentMode.COLOCATE and cfg.rollout.distributed_engines == 0:
        return "colocated"
    return "distributed"


class TrainWorker:
    def __init__(self, cfg: TrainerConfig, threads: int | None = None):
        from kora_trainer.backends.select import make_backend

        self.cfg = cfg
        self.backend = make_backend(cfg, threads=threads)  # torch or megatron: backends/select.py
        self.sender: Any = None

    def describe(self) -> dict[str, Any]:
        """Which backend trains, on which device (the driver prints it)."""
        return {"backend": type(self.backend).__name__, "device": str(self.backend.device)}

    def connect(self, engine_urls: list[str], kind: str) -> str:
        import torch

        from kora_trainer.sync.fast_sender import with_fast_path
        from kora_trainer.sync.transport import ColocatedTransport, DistributedTransport
        from kora_trainer.wire.engine_client import EngineClient

        clients = [EngineClient(u) for u in engine_urls]
        transport: DistributedTransport | ColocatedTransport
        if kind == "distributed":
            backend = "nccl" if self.backend.device.type == "cuda" and torch.distributed.is_nccl_available() else "gloo"
            transport = DistributedTransport.connect(clients, backend=backend)
        else:
            transport = ColocatedTransport(clients)
        self.sender = with_fast_path(self.backend.make_sender(transport), self.cfg)  # sync/fast_sender.py
        return transport.kind

    def sync(self) -> SyncReport:
        report: SyncReport = self.sender.sync(self.backend.version)  # a dataclass through Ray, not a dict
        return report

    def train_step(self, batch: RolloutBatch) -> StepMetrics:
        return self.backend.train_step(batch)

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        return self.backend.logprobs(prompts, responses)

    # ---- checkpoints (checkpoint/training.py says what they hold and what resuming reproduces) ----------

    def check_lora_only(self) -> None:
        self.backend.check_lora_only()

    def resume(self, root: str) -> dict[str, Any] | None:
        """Restore the newest good checkpoint under root (adapter, optimizer, RNG, version)."""
        from kora_trainer.checkpoint.training import restore_training_state

        resumed = restore_training_state(Path(root), self.backend)
        return resumed.as_dict() if resumed is not None else None

    def save_checkpoint(self, root: str, data_position: int, keep: int, meta: dict[str, Any]) -> str:
        from kora_trainer.checkpoint.training import save_training_state

        return str(save_training_state(Path(root), self.backend, data_position=data_position, keep=keep, meta=meta))

    def export_hf(self, root: str, meta: dict[str, Any]) -> str:
        from kora_trainer.checkpoint.training import export_adapter

        return str(export_adapter(Path(root), self.backend, self.cfg, meta))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class EngineWorker:
    def __init__(self, cfg: TrainerConfig, log_dir: str, threads: int | None, index: int):
        self.engine = EngineProcess.start(cfg, Path(log_dir), threads=threads, index=index)

    def url(self) -> str:
        return self.engine.url

    def pid(self) -> int:
        return int(self.engine.proc.pid)

    def stop(self) -> None:
        self.engine.stop()


class RolloutWorker:
    def __init__(self, cfg: TrainerConfig, engine_urls: list[str]):
        self.rollout = Rollout(cfg, engine_urls)

    def generate(self, step: int) -> tuple[RolloutBatch, dict[str, Any]]:
        return self.rollout.generate(step)

    def skip_to(self, position: int) -> int:
        return self.rollout.skip_to(position)

    def close(self) -> None:
        self.rollout.close()
