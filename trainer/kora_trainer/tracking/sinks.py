"""The trackers a job's `tracking:` section turns on, each behind the same two calls: `log(scalars, step)` and
`close()`. TensorBoard through torch.utils.tensorboard's SummaryWriter; W&B through `wandb` (an optional extra),
offline unless the job says online, so a run never reaches the network by default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from kora_trainer.config.sections import TrackingSpec, WandbMode, WandbSpec

TENSORBOARD_DIR = "tensorboard"  # under the run directory unless tracking.tensorboard.logDir says otherwise
FLUSH_S = 5  # SummaryWriter's flush period: a watcher sees a step within seconds, not its default 2 minutes


class TrackingError(Exception):
    """A tracker the job asks for cannot start (its package is missing, its directory is not writable)."""


class Sink(Protocol):
    where: str  # what the start line prints: the directory (or URL) the tracker writes to

    def log(self, scalars: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - TensorBoard only when a job tracks there
        except ImportError as e:  # torch's module imports the tensorboard package
            raise TrackingError(f"tracking.tensorboard needs the tensorboard package ({e}): pip install "
                                "tensorboard, or set tracking.tensorboard.enabled=false") from None
        self.where = str(log_dir)
        self._writer = SummaryWriter(log_dir=str(log_dir), flush_secs=FLUSH_S)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, spec: WandbSpec, run_dir: Path, config: Mapping[str, Any]):
        offline = spec.mode == WandbMode.OFFLINE
        if offline:
            # before the import: wandb reads its mode from the environment too, and offline must win over a
            # WANDB_MODE=online inherited from the shell (the job's spec says where the run goes)
            os.environ["WANDB_MODE"] = "offline"
        try:
            import wandb  # noqa: PLC0415 - W&B only when a job tracks there
        except ImportError:
            raise TrackingError("tracking.wandb needs the wandb package: pip install 'kora[wandb]' (the trainer "
                                "image has it), or set tracking.wandb.enabled=false") from None
        directory = Path(spec.dir) if spec.dir else run_dir
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=spec.project, entity=spec.entity, name=spec.name or run_dir.name,
                               dir=str(directory), mode="offline" if offline else "online", config=dict(config),
                               settings=wandb.Settings(console="off", disable_git=True, x_disable_stats=True))
        self.where = str(self._run.dir) if offline else str(self._run.url)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


def open_sinks(spec: TrackingSpec, run_dir: Path, config: Mapping[str, Any]) -> list[Sink]:
    """The trackers `spec` turns on, started; `config` (the job's trainer config) goes to W&B's run config."""
    sinks: list[Sink] = []
    try:
        if spec.tensorboard.enabled:
            sinks.append(TensorBoardSink(Path(spec.tensorboard.log_dir or run_dir / TENSORBOARD_DIR)))
        if spec.wandb.enabled:
            sinks.append(WandbSink(spec.wandb, run_dir, config))
    except BaseException:
        for s in sinks:
            s.close()
        raise
    return sinks
