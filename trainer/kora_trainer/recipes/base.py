"""What every recipe shares: the interface train.py calls, the run's one clock and the one engine watch.

A recipe (torchtune's habit: one recipe per file behind one small interface) is a class built from the job's
config, the clock and the torch threads; train.py calls it in this order: `make_toy` (--make-toy, model.path
empty), `total_steps` and `serving_check` (what the recorder is built with), `control_routes` (what the control
plane serves beside /status), `train`, then `close` (what `train` started, stopped, also after a failure) and,
when the run succeeded, `summarize`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kora_trainer.orchestration.cluster import Job, shutdown, start_ray
from kora_trainer.orchestration.data import load_rows
from kora_trainer.orchestration.engine_watch import engine_process_watched, engines_watched
from kora_trainer.toys.lm import make_toy
from kora_trainer.toys.vl import make_vl_toy

if TYPE_CHECKING:
    from kora_trainer.config import TrainerConfig
    from kora_trainer.orchestration.engine_watch import HangWatch
    from kora_trainer.orchestration.engines import EngineProcess
    from kora_trainer.recorder import StepRecorder
    from kora_trainer.serving_check import ServingCheck

SHUTDOWN_S = 5.0  # stopping the engines and Ray, kept in reserve by --time-limit


@dataclass(frozen=True)
class Clock:
    """The command's wall time, Ray start included, and its --time-limit: one for the whole run (the recorder's
    wall_s and every recipe's stop check read it)."""

    limit: float | None  # --time-limit seconds (None: no limit)
    start: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def fits(self, next_s: float = 0.0) -> bool:
        """False once `next_s` more seconds (the next step's, as long as the last one took) and the shutdown's
        reserve would run past the limit."""
        return not self.limit or self.elapsed() + next_s + SHUTDOWN_S < self.limit


class RecipeRefused(Exception):
    """A job the recipe refuses before anything starts (train.py prints it and exits 2)."""


class Recipe(Protocol):
    """What train.py calls of a recipe, in this order (the module docstring)."""

    def make_toy(self) -> None:
        """--make-toy with nothing at model.path: the toy model and data this recipe trains."""

    def total_steps(self) -> int:
        """The steps the recorder counts toward (0: the recipe counts its own, e.g. per adapter)."""

    def serving_check(self) -> ServingCheck | None:
        """The job's check that the engines serve the pushed policy (None: the recipe keeps its own)."""

    def control_routes(self, root: str | None) -> Any:
        """Routes the control plane serves beside /status (None: none); raises RecipeRefused."""

    def train(self, rec: StepRecorder, root: str | None, run_dir: Path) -> None:
        """Start the job's processes and run its steps (`root`: checkpoint.path resolved, None: no checkpoints)."""

    def close(self) -> None:
        """Stop what `train` started (bounded; after a failure too)."""

    def summarize(self, rec: StepRecorder) -> None:
        """The summary event and line of a run that succeeded."""


Watched = Callable[[str, int | None], AbstractContextManager[None]]  # (doing, newest saved step) -> the watch


class EngineWatch:
    """`with watch("step 3's weight sync"):` turns a failure while an engine is dead or hung into EngineLost
    naming it, what the driver was doing and which checkpoint a retry resumes from (orchestration/engine_watch.py:
    why the attempt fails rather than restart the engine). One for every recipe: `of_ray_engines` for a job's
    Ray engine workers, `of_process` for an engine process of the driver's own."""

    def __init__(self, rec: StepRecorder, watched: Watched):
        self.rec, self.watched = rec, watched

    def __call__(self, doing: str) -> AbstractContextManager[None]:
        return self.watched(doing, self.rec.run.saved_step)

    @classmethod
    def of_ray_engines(cls, job: Job, cfg: TrainerConfig, rec: StepRecorder, resume: str | None = None
                       ) -> EngineWatch:
        """The job's engines through their Ray workers; their hang watches get rollout.engineHangSeconds to
        decide. `resume`: what a retry resumes from, when not the newest checkpoint of this attempt."""
        return cls(rec, lambda doing, saved: engines_watched(job.engines, job.engine_urls, doing, saved,
                                                             cfg.rollout.engine_hang_seconds, resume=resume))

    @classmethod
    def of_process(cls, engine: EngineProcess, hang: HangWatch, rec: StepRecorder) -> EngineWatch:
        """One engine process of this driver's own (no Ray), with the HangWatch that kills it when it hangs."""
        return cls(rec, lambda doing, saved: engine_process_watched(engine.proc, engine.url, engine.log_path, hang,
                                                                    doing, saved))


@dataclass
class RayJob:
    """A language-model job's Ray side (orchestration/cluster.py): `connect` joins RAY_ADDRESS's cluster or starts
    a private head; the recipe keeps its `job` (the actors) here; `stop` tears down what was started."""

    job: Job | None = None
    started_ray: bool = False
    temp_dir: str | None = None

    def connect(self) -> None:
        self.started_ray, self.temp_dir = start_ray()  # imports Ray, after setting the environment Ray reads

    def stop(self) -> None:
        shutdown(self.job, self.started_ray, self.temp_dir)


def total_steps(cfg: TrainerConfig) -> int:
    """algorithm.numSteps, else numEpochs passes over data.path in batches of rolloutBatchSize."""
    alg = cfg.algorithm
    if alg.num_steps is not None:
        return int(alg.num_steps)

    rows = len(load_rows(cfg.data.path, cfg.data.input_key, cfg.data.label_key))
    return max(1, (alg.num_epochs or 1) * rows // alg.rollout_batch_size)


def make_lm_toy(cfg: TrainerConfig, threads: int) -> None:
    """The toy language model and its data at model.path: the vision-language one for a job with image prompts."""
    if cfg.data.image_key is not None:
        print(f"making the vision-language toy in {cfg.model.path} (kora make-toy --vl)", flush=True)
        make_vl_toy(cfg.model.path, threads=threads)
        return

    print(f"making the toy model and dataset in {cfg.model.path} (kora make-toy)", flush=True)
    make_toy(cfg.model.path, threads=threads)
