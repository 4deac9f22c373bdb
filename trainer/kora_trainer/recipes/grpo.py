"""The GRPO recipe: one LoRA adapter on a language model, trained on Ray by GRPO.

The driver, top to bottom (`GRPO.train`): Ray, the placement group, the engines and the trainer's ranks, the
rollout manager (orchestration/cluster: place, start_models, start_rollout); resume from the newest good
checkpoint under `checkpoint.path` if there is one, push the (initial or restored) policy; then per step:
generate -> score -> GRPO update -> update the engines' weights, publishing progress on the control plane, with a
LoRA-only checkpoint every `checkpoint.interval` steps and at the last step (`checkpoint.exportHF` / --save-hf also
writes `<checkpoint.path>/lora_adapter/` at the end). With `deployment.async` the engines generate the next steps'
rollouts while the current step trains, at most `deployment.maxStaleness` (default 1) steps ahead, so a rollout
lags the policy by at most that many versions (`rollout_lag_max`). It ends with one JSON line: {"event":
"summary", "steps", "first_step", "resumed_from_step", "sync_mode", "reward_first", "reward_last", "loss_curve",
...} (reward_first / reward_last: mean training reward over the first / last 10 steps this process ran;
loss_curve: each step's policy loss, unrounded; sync_paths: pushes and median ms per sync path, `http` or `fast`
— sync/fast_sender.py, whose decision the log's `sync: ...` line gives).

Resume: a run restarted on the same checkpoint.path prints `resumed from checkpoint step K (<dir>)` (and
every newer checkpoint it refused, with the reason: a torn or corrupted one is never loaded), reports
`resumedFromStep` on /status, pushes the restored policy as its first sync and continues with step K+1.
With `deployment.async: false`, steps K+1... reproduce the uninterrupted run exactly (same seed, CPU; see
checkpoint/training.py for what is saved and why that suffices). With `deployment.async: true`
exactness is not claimed: the uninterrupted run generated step K+1's rollouts with policy K-1 while step
K trained, and that in-flight generation is not in the checkpoint, so the resumed run regenerates step
K+1's rollouts from policy K.

Everything the loop records goes through recorder.StepRecorder: stdout, the control plane's progress, and the
JSON-lines event file `<run dir>/events.jsonl` (one event per step, sync, checkpoint, and the summary; the
recorder's docstring lists them).

An engine that dies under the run, or hangs for rollout.engineHangSeconds, fails the attempt with EngineLost
naming it (orchestration/engine_watch.py); a checkpoint the disk has no room for fails it with
CheckpointWriteError naming the path and the bytes, the previous checkpoint still the newest good one
(checkpoint/lora_only.py). Either way a retry resumes.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kora_trainer import heap
from kora_trainer.orchestration.cluster import place, start_models, start_rollout
from kora_trainer.recipes.base import Clock, EngineWatch, RayJob, make_lm_toy, total_steps
from kora_trainer.serving_check import ServingCheck

if TYPE_CHECKING:
    from kora_trainer.config import TrainerConfig
    from kora_trainer.orchestration.cluster import Job
    from kora_trainer.recorder import StepRecorder


class Lookahead:
    """The rollouts queued ahead of the trainer. With deployment.async the engines generate up to maxStaleness
    steps ahead while the trainer trains, so a rollout lags the policy by at most that many versions (the
    clipped ratio against the engines' own log-probs corrects for it); without, the next step's rollouts are
    generated while the trainer writes its checkpoint. Generations queue on the one rollout actor, which runs
    them in order; a batch goes to the trainer without visiting the driver."""

    def __init__(self, job: Job, cfg: TrainerConfig, start: int, steps: int):
        self.gen = job.rollout.generate.options(num_returns=2)
        self.ahead = cfg.deployment.max_staleness if cfg.deployment.async_ else 0
        self.steps, self.issued = steps, start  # the last step whose generation is queued
        self.queue: deque[list[Any]] = deque()  # [batch, stats] refs (ray gives num_returns=2 as a list)
        self.issue_through(start + 1)

    def issue_through(self, last: int) -> None:
        while self.issued < min(last, self.steps):
            self.issued += 1
            self.queue.append(self.gen.remote(self.issued))

    def take(self, step: int) -> list[Any]:
        """This step's (batch, stats) refs; queues what async may generate meanwhile."""
        refs = self.queue.popleft()
        self.issue_through(step + self.ahead)
        return refs


def resume(job: Job, cfg: TrainerConfig, root: str, rec: StepRecorder) -> None:
    """SPEC rule 8, then the newest checkpoint under root that verifies (newer refused ones are logged)."""
    import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

    if cfg.checkpoint.lora_only:
        job.trainer.first("check_lora_only")
    info = job.trainer.all("resume", root)[0]  # every rank restores the same state (data-parallel replicas)
    if info is None:
        rec.say(f"no checkpoint under {root}: starting at step 1")
        return
    rec.resumed(info)
    rec.run.data_position = ray.get(job.rollout.skip_to.remote(info["data_position"]))


def save_checkpoint(job: Job, cfg: TrainerConfig, root: str, step: int, rec: StepRecorder) -> None:
    t0 = time.monotonic()
    meta = {"sync_mode": str(cfg.lora.effective_sync_mode), "base_model": str(Path(cfg.model.path).resolve()),
            "seed": cfg.algorithm.seed, "async": cfg.deployment.async_}
    path = job.trainer.written("save_checkpoint", root, rec.run.data_position, cfg.checkpoint.keep, meta)
    rec.checkpointed(step, path, (time.monotonic() - t0) * 1000)


class GRPO:
    """The recipe (recipes/base.Recipe) of a job with neither a `diffusion` section nor multiLora adapters."""

    def __init__(self, cfg: TrainerConfig, clock: Clock, threads: int = 1):
        self.cfg, self.clock, self.threads = cfg, clock, threads
        self.ray = RayJob()

    def make_toy(self) -> None:
        make_lm_toy(self.cfg, self.threads)

    def total_steps(self) -> int:
        return total_steps(self.cfg)

    def serving_check(self) -> ServingCheck:
        return ServingCheck(self.cfg.sync.served_logp_gap_max, self.cfg.sync.served_bad_steps_to_fail)

    def control_routes(self, root: str | None) -> None:
        return None

    def train(self, rec: StepRecorder, root: str | None, run_dir: Path) -> None:
        """Placement, models, rollout manager; resume, push the policy, then per step: generate, train, update
        weights, save; export at the end."""
        self.ray.connect()
        placed = place(self.cfg)  # the placement group, ready
        models = start_models(placed, run_dir, self.threads)  # the engines, and the trainer's ranks loading the model
        job = self.ray.job = start_rollout(placed, models)  # the rollout manager; each rank's transport to its engines
        watch = EngineWatch.of_ray_engines(job, self.cfg, rec)
        if root:
            resume(job, self.cfg, root, rec)
        with watch("the first push of the policy"):
            first_push = job.trainer.sync()
        rec.started(job.info, len(job.engines), self.cfg.rollout.engine, job.transport, first_push)
        self.steps(job, watch, rec, root)
        self.finish(job, rec, root)

    def steps(self, job: Job, watch: EngineWatch, rec: StepRecorder, root: str | None) -> None:
        """Per step: generate, train, update the engines' weights, save, while --time-limit leaves room."""
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        rollouts, last_step_s = Lookahead(job, self.cfg, rec.run.start, rec.steps), 0.0
        for step in range(rec.run.start + 1, rec.steps + 1):
            if not self.clock.fits(last_step_s):
                rec.stopped(f"time limit {self.clock.limit:.0f}s: stopping after step {step - 1}")
                break
            t_step = time.monotonic()
            with watch(f"step {step}'s rollouts and update"):
                batch_ref, stats_ref = rollouts.take(step)
                metrics, rstats = job.trainer.train_step(batch_ref), ray.get(stats_ref)
            with watch(f"step {step}'s weight sync"):
                pushed = job.trainer.sync()
            rec.stepped(step, metrics, rstats, pushed)
            rollouts.issue_through(step + 1)
            if root and (step % self.cfg.checkpoint.interval == 0 or step == rec.steps):
                save_checkpoint(job, self.cfg, root, step, rec)
            last_step_s = time.monotonic() - t_step
            if step == rec.run.start + 1:  # start-up and what the first step imported: out of later full collections
                heap.freeze("the trainer's driver")

    def finish(self, job: Job, rec: StepRecorder, root: str | None) -> None:
        """A run stopped early keeps its last step; checkpoint.exportHF writes the HF-PEFT adapter."""
        if root and rec.run.rewards and rec.run.done != rec.run.saved_step:
            save_checkpoint(job, self.cfg, root, rec.run.done, rec)
        if root and self.cfg.checkpoint.export_hf:
            rec.exported(job.trainer.written("export_hf", root, {"seed": self.cfg.algorithm.seed}))

    def close(self) -> None:
        self.ray.stop()

    def summarize(self, rec: StepRecorder) -> None:
        job = self.ray.job
        rec.summary(job.transport if job else None, job.info.get("backend") if job else None)
