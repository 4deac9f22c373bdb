"""The Flow-GRPO recipe, for a job with a `diffusion` section: Flow-GRPO on a diffusion transformer's LoRA adapter.

What runs (docs/diffusion.md): this process trains (one rank, the torch backend), and the reference diffusion
engine beside it (rollout.engine hf; deployment.mode Colocate: the weights go by same-host handles) serves the
rollouts. The loop, as recipes/grpo.py's: start the engine, resume from the newest good LoRA-only checkpoint under
checkpoint.path, push the (initial or restored) policy, then per step: the engine's images of rolloutBatchSize
prompts x nSamplesPerPrompt (each with every denoising step's latent and log-prob) -> reward -> group advantages
-> the trainer's re-score and clipped update -> sync (Merge: the adapted weights folded here, fp32 rounded once;
EngineMerge: the A/B pairs, whole pairs per bucket, for the engine to fold into its pristine base) -> a checkpoint
every checkpoint.interval steps. Everything goes through recorder.StepRecorder (events, /status, trackers, the
serving check), so the operator and the tests read a diffusion run as they read a language-model one.

Which prompts a step takes and every image's noise are functions of (algorithm.seed, step), so a resumed run
repeats the uninterrupted run's steps exactly: it restores the adapter, the optimizer and the RNG, and pushes the
restored policy first. With checkpoint.exportHF the adapter goes out at the end as diffusers' own LoRA file
(diffusion/export.py).

Ranks: at parallelism.data 1 this process trains (no Ray); at N > 1 it starts a private Ray head (or joins
RAY_ADDRESS's cluster) and N rank actors (orchestration/diffusion_ranks.py), each holding the transformer
FSDP2-sharded over the ranks; this process keeps the engine and the rollouts and hands each rank its rows. Both
hold the policy as diffusion/actor.DiffusionPolicy, so a step is the same update on the same rows (FSDP2 averages
the ranks' gradients) and a checkpoint (the optimizer state gathered whole) resumes at any rank count. Not built
yet (refused by config/rules.py): tensor / pipeline / context / expert parallelism, launching sglang-diffusion,
data-parallel ranks on GPUs.

Device: rollout.gpusPerEngine 1 puts the engine and this process's policy on the same GPU (diffusion/actor.device_of),
a push then hands the engine CUDA IPC handles; 0 keeps both on the CPU.
"""

from __future__ import annotations

import ast
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kora_trainer.algorithm import flow_grpo
from kora_trainer.algorithm.diffusion_rewards import colour_reward
from kora_trainer.algorithm.lr_schedule import lr_at
from kora_trainer.algorithm.rewards import load_custom

# the policy's side of the job (backends/diffusion/actor.py, which the Ray ranks import too); tests, bench/ use it here
from kora_trainer.backends.diffusion.actor import (
    Batch,
    DiffusionJobError,
    DiffusionPolicy,
    device_of,
    export,
    load_model,
    make_sync,
    settings_of,
)
from kora_trainer.backends.grpo_step import StepMetrics
from kora_trainer.config.sections import DiffusionReward
from kora_trainer.orchestration.cluster import shutdown, start_ray
from kora_trainer.orchestration.data import load_rows
from kora_trainer.orchestration.diffusion_ranks import DiffusionRanks
from kora_trainer.orchestration.engine_watch import HangWatch
from kora_trainer.orchestration.engines import EngineProcess
from kora_trainer.recipes.base import Clock, EngineWatch, total_steps
from kora_trainer.serving_check import ServingCheck
from kora_trainer.sync.sender import SyncReport
from kora_trainer.toys.diffusion import make_diffusion_toy
from kora_trainer.wire.diffusion_client import EngineRollout
from kora_trainer.wire.ports import free_port

if TYPE_CHECKING:
    from kora_trainer.backends.diffusion.actor import Batch
    from kora_trainer.backends.diffusion.train_loop import FlowGRPOSettings
    from kora_trainer.config import TrainerConfig
    from kora_trainer.orchestration.diffusion_ranks import DiffusionRanks
    from kora_trainer.orchestration.engines import EngineProcess
    from kora_trainer.recorder import StepRecorder
    from kora_trainer.sync.sender import SyncReport
    from kora_trainer.toys.diffusion import DiffusionToy
    from kora_trainer.wire.diffusion_client import EngineRollout, Pushed

ENGINE_READY_S = 180.0


@dataclass(frozen=True)
class Prompts:
    """data.path's rows: each row's prompt id in the model's prompt table, its text and its label."""

    ids: torch.Tensor  # [P] long
    texts: list[str]
    labels: list[Any]


def load_prompts(cfg: TrainerConfig, toy: DiffusionToy) -> Prompts:
    """data.path's prompts, each one the model's prompt table holds (the toy embeds prompts by table, not by a
    text encoder)."""
    rows = load_rows(cfg.data.path, cfg.data.input_key, cfg.data.label_key)
    table = {p: i for i, p in enumerate(toy.prompts)}
    unknown = sorted({str(r.prompt) for r in rows if r.prompt not in table})
    if not rows or unknown:
        raise DiffusionJobError(
            f"data.path {cfg.data.path}: " + (f"prompts {unknown[:3]} are not in {cfg.model.path}/prompts.jsonl"
                                              if unknown else "no rows")
            + f" (data.inputKey {cfg.data.input_key}): the model embeds prompts by its table (no text encoder yet), "
            f"so each must be one of its {len(toy.prompts)}: e.g. data.path {cfg.model.path}/prompts.jsonl")
    return Prompts(torch.tensor([table[r.prompt] for r in rows]), [str(r.prompt) for r in rows],
                   [_value(r.label) for r in rows])


def _value(label: str) -> Any:
    """A label as the data file held it (load_rows gives text: a target colour comes back as a list)."""
    for parse in (json.loads, ast.literal_eval):
        with contextlib.suppress(ValueError, SyntaxError):
            return parse(label)
    return label


RewardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (images [B, C, H, W], rows [B]) -> rewards [B]


def reward_of(cfg: TrainerConfig, prompts: Prompts, channels: int) -> RewardFn:
    """diffusion.reward: colour (the labels are target colours, data.labelKey), or data.customRewardPath's
    `fn(images, prompts, labels) -> [B]`."""
    assert cfg.diffusion is not None
    if cfg.diffusion.reward is DiffusionReward.COLOUR:
        bad = [lab for lab in prompts.labels if not (isinstance(lab, list) and len(lab) == channels)]
        if bad:
            raise DiffusionJobError(f"data.labelKey {cfg.data.label_key}: diffusion.reward colour needs each row's "
                                    f"label to be its target colour, {channels} numbers (one per latent channel), "
                                    f"not {bad[0]!r}: point data.labelKey at that column (the toy's is target)")
        targets = torch.tensor(prompts.labels, dtype=torch.float32)
        return lambda images, rows: colour_reward(images, targets[rows])

    assert cfg.data.custom_reward_path is not None
    fn: Any = load_custom(cfg.data.custom_reward_path)

    def custom(images: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = torch.as_tensor(fn(images, [prompts.texts[i] for i in rows.tolist()],
                                 [prompts.labels[i] for i in rows.tolist()]), dtype=torch.float32)
        if out.shape != (images.shape[0],):
            raise DiffusionJobError(f"data.customRewardPath {cfg.data.custom_reward_path} returned shape "
                                    f"{tuple(out.shape)}: it must return one reward per image, [{images.shape[0]}]")
        return out
    return custom


def step_rows(seed: int, step: int, n_rows: int, k: int) -> torch.Tensor:
    """The k rows of data.path step `step` trains on: a permutation drawn from (seed, step) alone, so a resumed
    run takes the same rows (more than n_rows: whole permutations, then part of one more)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    perms = [torch.randperm(n_rows, generator=g) for _ in range(-(-k // n_rows))]
    return torch.cat(perms)[:k]


def start_engine(cfg: TrainerConfig, run_dir: Path, threads: int, device: torch.device) -> EngineProcess:
    """The reference diffusion engine on 127.0.0.1 and `device`, stopped by pid (orchestration/engines.EngineProcess)"""
    port = free_port("127.0.0.1")
    argv = [sys.executable, "-m", "kora_engine.diffusion.server", "--toy", str(Path(cfg.model.path).resolve()),
            "--port", str(port), "--num-threads", str(threads), "--device", device.type]
    return EngineProcess.launch(argv, f"http://127.0.0.1:{port}", run_dir / "engines", threads, ENGINE_READY_S)


def sync_report(cfg: TrainerConfig, pushed: Pushed, version: int) -> SyncReport:
    return SyncReport(mode=str(cfg.lora.effective_sync_mode), transport="colocated", pushed=True, bytes=pushed.bytes,
                      ms=pushed.ms, adapter_version=version, checksum=None, buckets=pushed.buckets, what=pushed.what)


class LocalPolicy:
    """parallelism.data 1: the policy in this process (no Ray), pushed from its own transformer."""

    def __init__(self, cfg: TrainerConfig, toy: DiffusionToy, engine_url: str):
        self.cfg, self.policy, self.push = cfg, DiffusionPolicy(cfg, toy), make_sync(cfg, engine_url)

    def train(self, step: int, batch: Batch) -> list[list[dict[str, float]]]:
        return [self.policy.train(step, batch)]

    def sync(self) -> Pushed:
        pushed: Pushed = self.push(self.policy.toy.transformer)
        return pushed

    def save(self, root: str, step: int) -> Path:
        path = self.policy.save(root, step)
        assert path is not None  # rank 0 writes
        return path

    def resume(self, root: str) -> dict[str, Any] | None:
        return self.policy.resume(root)

    def export(self, root: str, step: int) -> Path:
        return export(self.cfg, root, step, self.policy.toy.transformer)

    def close(self) -> None:
        pass


def combine(per_rank: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Each pass's stats over the ranks (rank order; one rank: its own): equal shares, so the means of the ranks'
    means are the batch's means; the largest gap is the largest rank's; clip_grad_norm_ reduced the norm over the
    shards, so every rank has the whole one."""
    out = []
    for passes in zip(*per_rank, strict=True):
        n = len(passes)
        mean = {k: sum(p[k] for p in passes) / n for k in ("loss", "clip_frac", "kl", "ratio_mean", "logp_gap_mean")}
        out.append({**mean, "logp_gap_max": max(p["logp_gap_max"] for p in passes),
                    "grad_norm": passes[0]["grad_norm"]})
    return out


class DiffusionSteps:
    """What the driver does of a step whatever the rank count: the step's rows, the engine's rollouts of them, the
    reward and the group advantages; then the trainer's update and the step's metrics."""

    def __init__(self, cfg: TrainerConfig, toy: DiffusionToy, prompts: Prompts):
        self.cfg, self.toy, self.prompts = cfg, toy, prompts
        self.settings = settings_of(cfg)
        self.reward = reward_of(cfg, prompts, toy.latent_shape[0])

    def step(self, step: int, rollout: Callable[..., Any], trainer: LocalPolicy | DiffusionRanks,
             watch: EngineWatch) -> tuple[Any, float]:
        """Roll out, score, update: (StepMetrics, gen_ms)."""
        s, alg = self.settings, self.cfg.algorithm
        rows = step_rows(s.seed, step, len(self.prompts.ids), s.prompts_per_step).repeat_interleave(
            s.samples_per_prompt)  # [B] a prompt's G samples adjacent
        ids = self.prompts.ids[rows]
        t0 = time.perf_counter()
        with watch(f"step {step}'s rollouts"):
            traj = rollout(self.toy, ids, step)
        gen_ms = (time.perf_counter() - t0) * 1000
        t1 = time.perf_counter()
        rewards = self.reward(traj.images, rows)  # [B]
        adv = flow_grpo.advantages(rewards, s.samples_per_prompt, s.adv_clip)
        passes = combine(trainer.train(step, Batch(ids, traj, adv)))
        first = passes[0]  # its gap is measured before any update of this batch
        mean = {k: sum(p[k] for p in passes) / len(passes) for k in ("loss", "clip_frac", "kl", "ratio_mean",
                                                                     "grad_norm")}
        metrics = StepMetrics(
            version=step, reward_mean=float(rewards.mean()), samples=int(rows.numel()),
            updates=s.minibatches * alg.inner_epochs, loss=mean["loss"], clip_frac=mean["clip_frac"], kl=mean["kl"],
            ratio=mean["ratio_mean"], grad_norm=mean["grad_norm"], response_len=float(traj.num_steps),
            rollout_logp_gap_max=first["logp_gap_max"], rollout_logp_gap_mean=first["logp_gap_mean"],
            rollout_version_lag=0, train_ms=(time.perf_counter() - t1) * 1000, reward_std=float(rewards.std()),
            reward_min=float(rewards.min()), reward_max=float(rewards.max()),
            response_len_max=traj.num_steps, response_len_min=traj.num_steps,
            kl_measured=s.kl_coef > 0 or s.measure_kl, lr=lr_at(alg, step - 1))
        return metrics, gen_ms


@contextlib.contextmanager
def trainer_of(cfg: TrainerConfig, toy: DiffusionToy, engine: EngineProcess, threads: int
               ) -> Iterator[LocalPolicy | DiffusionRanks]:
    """parallelism.data 1: the policy here (LocalPolicy, on `toy` itself); N: N Ray rank actors, on a private Ray
    head (or RAY_ADDRESS's cluster), stopped at the end."""
    if cfg.parallelism.data == 1:
        yield LocalPolicy(cfg, toy, engine.url)
        return

    started, temp_dir = start_ray()
    ranks = None
    try:
        ranks = DiffusionRanks(cfg, engine.url, threads)
        yield ranks
    finally:
        if ranks is not None:
            ranks.close()
        shutdown(None, started, temp_dir)


class FlowGRPO:
    """The recipe (recipes/base.Recipe) of a job with a `diffusion` section."""

    def __init__(self, cfg: TrainerConfig, clock: Clock, threads: int = 1):
        assert cfg.diffusion is not None
        self.cfg, self.diffusion, self.clock, self.threads = cfg, cfg.diffusion, clock, threads

    def make_toy(self) -> None:
        print(f"making the diffusion toy in {self.cfg.model.path} (kora make-toy --diffusion)", flush=True)
        make_diffusion_toy(self.cfg.model.path)

    def total_steps(self) -> int:
        return total_steps(self.cfg)

    def serving_check(self) -> ServingCheck:
        return ServingCheck(self.diffusion.served_logp_gap_max, self.cfg.sync.served_bad_steps_to_fail,
                            field="diffusion.servedLogpGapMax")

    def control_routes(self, root: str | None) -> None:
        return None

    def train(self, rec: StepRecorder, root: str | None, run_dir: Path) -> None:
        """Start the engine and the trainer, resume, push, then per step: roll out, train, sync; checkpoint as
        checkpoint.* says. The engine and the ranks stop before this returns."""
        cfg = self.cfg
        torch.set_num_threads(self.threads)
        device = device_of(cfg)  # a GPU only at data 1 (rule diffusion-gpu-ranks): the ranks load their own CPU copies
        toy = load_model(cfg).to(device)
        steps = DiffusionSteps(cfg, toy, load_prompts(cfg, toy))
        engine = start_engine(cfg, run_dir, self.threads, device)
        hang = HangWatch(engine.proc, engine.url, cfg.rollout.engine_hang_seconds)  # a silent engine is killed: a hang
        try:
            with trainer_of(cfg, toy, engine, self.threads) as trainer:
                watch = EngineWatch.of_process(engine, hang, rec)
                rollout, first = self.begin(trainer, watch, rec, root, engine.url, steps.settings)
                ranks = getattr(trainer, "ranks", None)  # where each Ray rank runs (N > 1)
                rec.started({"backend": "torch", "device": device.type, "world": cfg.parallelism.data,
                             "engine_urls": [engine.url], **({"ranks": ranks} if ranks else {})}, 1,
                            "diffusion-reference", "colocated", first)
                self.steps(steps, rollout, trainer, watch, rec, root)
                self.finish(trainer, rec, root)
        finally:
            hang.stop()
            engine.stop()

    def begin(self, trainer: LocalPolicy | DiffusionRanks, watch: EngineWatch, rec: StepRecorder, root: str | None,
              engine_url: str, s: FlowGRPOSettings) -> tuple[EngineRollout, SyncReport]:
        """Resume from the newest good checkpoint under `root`, then the first push of the policy: the engine's
        rollout client and that push's report."""
        if root:
            info = trainer.resume(root)
            if info is None:
                rec.say(f"no checkpoint under {root}: starting at step 1")
            else:
                rec.resumed(info)
        rollout = EngineRollout(engine_url, s.seed, s.num_inference_steps, s.noise_level, s.guidance_scale)
        with watch("the first push of the policy"):
            first = self.synced(trainer, rec, rec.run.start)
        return rollout, first

    def steps(self, steps: DiffusionSteps, rollout: EngineRollout, trainer: LocalPolicy | DiffusionRanks,
              watch: EngineWatch, rec: StepRecorder, root: str | None) -> None:
        """Per step: roll out and train (DiffusionSteps.step), update the engine's weights, save."""
        for step in range(rec.run.start + 1, rec.steps + 1):
            if not self.clock.fits():
                rec.stopped(f"time limit: stopping after step {step - 1}")
                break
            metrics, gen_ms = steps.step(step, rollout, trainer, watch)
            with watch(f"step {step}'s weight sync"):
                report = self.synced(trainer, rec, step)
            rec.stepped(step, metrics, {"gen_ms": gen_ms, "data_position": step}, report)
            if root and (step % self.cfg.checkpoint.interval == 0 or step == rec.steps):
                self.checkpoint(trainer, rec, root, step)

    def finish(self, trainer: LocalPolicy | DiffusionRanks, rec: StepRecorder, root: str | None) -> None:
        """A run stopped early keeps its last step; checkpoint.exportHF writes diffusers' LoRA file."""
        if root and rec.run.rewards and rec.run.done != rec.run.saved_step:
            self.checkpoint(trainer, rec, root, rec.run.done)
        if root and self.cfg.checkpoint.export_hf:
            rec.exported(str(trainer.export(root, rec.run.done)), "diffusers LoRA")

    def synced(self, trainer: LocalPolicy | DiffusionRanks, rec: StepRecorder, version: int) -> SyncReport:
        pushed = trainer.sync()
        if pushed.log:
            rec.say(pushed.log)
        return sync_report(self.cfg, pushed, version)

    def checkpoint(self, trainer: LocalPolicy | DiffusionRanks, rec: StepRecorder, root: str, step: int) -> None:
        t0 = time.monotonic()
        path = trainer.save(root, step)
        rec.checkpointed(step, str(path), (time.monotonic() - t0) * 1000)

    def close(self) -> None:
        pass  # train stops its engine and ranks before it returns

    def summarize(self, rec: StepRecorder) -> None:
        rec.summary("colocated", "torch")
