"""`python -m kora_trainer.train --config FILE [key=value ...] [seed flags]`: one LoRA GRPO job.

The loop, top to bottom: start Ray and the workers (engines, trainer, rollout manager), resume from the
newest good checkpoint under `checkpoint.path` if there is one, push the (initial or restored) policy,
then per step generate -> score -> GRPO update -> sync, publishing progress on the control plane, with a
LoRA-only checkpoint every `checkpoint.interval` steps and at the last step (`checkpoint.exportHF` /
--save-hf also writes `<checkpoint.path>/lora_adapter/` at the end). With `deployment.async` the engines
generate the next steps' rollouts while the current step trains, at most `deployment.maxStaleness` (default
1) steps ahead, so a rollout lags the policy by at most that many versions (`rollout_lag_max`). It ends
with one JSON line: {"event": "summary", "steps", "first_step", "resumed_from_step", "sync_mode",
"reward_first", "reward_last", "loss_curve", ...} (reward_first / reward_last: mean training reward over
the first / last 10 steps this process ran; loss_curve: each step's policy loss, unrounded; sync_paths:
pushes and median ms per sync path, `http` or `fast` — sync/fast_sender.py, whose decision the log's
`sync: ...` line gives).

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

At the end the control plane lingers for the operator: until one authorized GET /status has returned
the final phase, or KORA_CONTROL_LINGER_S seconds (default 0) passed.

An engine that dies under the run, or hangs for rollout.engineHangSeconds, fails the attempt with EngineLost naming
it (orchestration/engine_watch.py);
a checkpoint the disk has no room for fails it with CheckpointWriteError naming the path and the bytes, the
previous checkpoint still the newest good one (checkpoint/lora_only.py). Either way a retry resumes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kora_trainer.config import TrainerConfig
    from kora_trainer.orchestration.cluster import Job
    from kora_trainer.recorder import StepRecorder

T_START = time.monotonic()  # the whole command's wall time counts, Ray start included
SHUTDOWN_S = 5.0  # stopping the engines and Ray, kept in reserve by --time-limit


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from kora_trainer.config.flags import add_seed_flags

    p = argparse.ArgumentParser(prog="python -m kora_trainer.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="job YAML: a trainer spec or a whole LoRATrainingJob")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. lora.syncMode=Adapter "
                   "(key+=[...] appends to a list)")
    p.add_argument("--run-dir", default=None, help="logs and the control-plane token (default .kora/runs/<time>)")
    p.add_argument("--control-port", type=int, default=None, help="control-plane port (default $KORA_CONTROL_PORT "
                   "or 8068; 0 picks a free one)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop after the last step that fits in this wall time (the summary says how many ran)")
    p.add_argument("--make-toy", action="store_true", help="first make the toy model and dataset at model.path "
                   "if nothing is there (what `kora make-toy DIR` does)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1: see orchestration/"
                   "cluster.py for why)")
    p.add_argument("--dry-run", action="store_true", help="print the placement (each rank's node, GPU and parallel "
                   "coordinates, each engine's GPUs, the weight-update group) and exit, starting nothing")
    p.add_argument("--nodes", default=None, metavar="NxG", help="--dry-run: plan on N nodes of G GPUs (default: "
                   "this machine)")
    p.add_argument("--json", action="store_true", help="--dry-run: the placement as one JSON object")
    add_seed_flags(p)
    return p.parse_args(argv)


def dry_run(cfg: TrainerConfig, args: argparse.Namespace) -> int:
    """`--dry-run`: config/placement.py's plan, on --nodes or on this machine (what a local run would get), then
    whether the ranks would refuse the layout at start (exit 2 with the reason and the fix)."""
    import json
    import os

    from kora_trainer.backends.select import check_actor_layout, resolve_backend, weights_bytes
    from kora_trainer.config import ConfigError, read_hf_config
    from kora_trainer.config.placement import Node, parse_nodes, plan_job
    from kora_trainer.config.start_layout import config_experts

    try:
        if args.nodes:  # a cluster elsewhere: assume its image has megatron-core where it has GPUs
            nodes = parse_nodes(args.nodes)
            megatron = any(n.gpus for n in nodes)
        else:
            import torch

            from kora_trainer.backends.megatron import megatron_available

            nodes = [Node("local", float(os.cpu_count() or 1), torch.cuda.device_count())]
            megatron = bool(nodes[0].gpus) and megatron_available()
        job_plan = plan_job(cfg, nodes)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(job_plan.as_dict()) if args.json else "\n".join(job_plan.lines()))
    size = weights_bytes(cfg.model.path)
    try:
        hf = read_hf_config(cfg.model.path) or {}
        check_actor_layout(cfg, resolve_backend(cfg, cuda=any(n.gpus for n in nodes), megatron=megatron,
                                                model_bytes=size),
                           hf.get("num_hidden_layers"), config_experts(hf))
    except ConfigError as e:
        unread = "" if size else f" (model.path {cfg.model.path} is not readable here: backend auto took torch)"
        print(f"the trainer would refuse this job at start{unread}: {e}", file=sys.stderr)
        return 2
    return 0


def total_steps(cfg: TrainerConfig) -> int:
    alg = cfg.algorithm
    if alg.num_steps is not None:
        return int(alg.num_steps)
    from kora_trainer.orchestration.data import load_rows

    rows = len(load_rows(cfg.data.path, cfg.data.input_key, cfg.data.label_key))
    return max(1, (alg.num_epochs or 1) * rows // alg.rollout_batch_size)


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
    import ray

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


def load(args: argparse.Namespace) -> TrainerConfig | None:
    """The job's config with its overrides and seed flags (None: refused, the reason printed); with --make-toy
    the toy is made at model.path first when nothing is there."""
    from kora_trainer.config import ConfigError, load_config
    from kora_trainer.config.flags import as_overrides, origins, seed_flag_values

    try:
        flags = seed_flag_values(args)
        cfg, warnings = load_config(args.config, [*args.overrides, *as_overrides(flags)], origins=origins(flags))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return None
    for w in warnings:
        print(f"warning: {w.message}", flush=True)
    if not args.dry_run and not Path(cfg.model.path).exists():  # a plan needs no model
        if not args.make_toy:
            print(f"model.path {cfg.model.path} does not exist: point model.path at an HF checkpoint directory, or "
                  "pass --make-toy to make the toy model and dataset there", file=sys.stderr)
            return None
        if cfg.diffusion is not None:
            from kora_trainer.toys.diffusion import make_diffusion_toy

            print(f"making the diffusion toy in {cfg.model.path} (kora make-toy --diffusion)", flush=True)
            make_diffusion_toy(cfg.model.path)
            return cfg
        if cfg.data.image_key is not None:  # a job with image prompts: the vision-language toy
            from kora_trainer.toys.vl import make_vl_toy

            print(f"making the vision-language toy in {cfg.model.path} (kora make-toy --vl)", flush=True)
            make_vl_toy(cfg.model.path, threads=args.threads)
            return cfg
        from kora_trainer.toys.lm import make_toy

        print(f"making the toy model and dataset in {cfg.model.path} (kora make-toy)", flush=True)
        make_toy(cfg.model.path, threads=args.threads)
    return cfg


def watched(job: Job, cfg: TrainerConfig, rec: StepRecorder, doing: str) -> Any:
    """A failure while an engine is dead or hung becomes EngineLost, naming it (orchestration/engine_watch.py: why
    the attempt fails rather than restart the engine); the engines' hang watches get their bound to decide."""
    from kora_trainer.orchestration.engine_watch import engines_watched

    return engines_watched(job.engines, job.engine_urls, doing, rec.run.saved_step, cfg.rollout.engine_hang_seconds)


def train(job: Job, cfg: TrainerConfig, rec: StepRecorder, root: str | None, time_limit: float | None) -> None:
    """Resume, push the policy, then per step: generate, train, sync, checkpoint; export at the end."""
    import ray

    from kora_trainer import heap

    if root:
        resume(job, cfg, root, rec)
    with watched(job, cfg, rec, "the first push of the policy"):
        first_push = job.trainer.sync()
    rec.started(job.info, len(job.engines), cfg.rollout.engine, job.transport, first_push)
    rollouts, last_step_s = Lookahead(job, cfg, rec.run.start, rec.steps), 0.0
    for step in range(rec.run.start + 1, rec.steps + 1):
        if time_limit and time.monotonic() - T_START + last_step_s + SHUTDOWN_S > time_limit:
            rec.stopped(f"time limit {time_limit:.0f}s: stopping after step {step - 1}")
            break
        t_step = time.monotonic()
        with watched(job, cfg, rec, f"step {step}'s rollouts and update"):
            batch_ref, stats_ref = rollouts.take(step)
            metrics, rstats = job.trainer.train_step(batch_ref), ray.get(stats_ref)
        with watched(job, cfg, rec, f"step {step}'s weight sync"):
            pushed = job.trainer.sync()
        rec.stepped(step, metrics, rstats, pushed)
        rollouts.issue_through(step + 1)
        if root and (step % cfg.checkpoint.interval == 0 or step == rec.steps):
            save_checkpoint(job, cfg, root, step, rec)
        last_step_s = time.monotonic() - t_step
        if step == rec.run.start + 1:  # start-up and what the first step imported: out of later full collections
            heap.freeze("the trainer's driver")
    if root and rec.run.rewards and rec.run.done != rec.run.saved_step:  # stopped early: keep the last step
        save_checkpoint(job, cfg, root, rec.run.done, rec)
    if root and cfg.checkpoint.export_hf:
        rec.exported(job.trainer.written("export_hf", root, {"seed": cfg.algorithm.seed}))


def adapter_registry(cfg: TrainerConfig, root: str | None) -> Any:
    """A multi-adapter job's registry (adapter_runs/registry.py): the adapters a previous attempt held (from
    `<checkpoint.path>/adapters/registry.json`), then those the job lists."""
    from kora_trainer.adapter_runs.registry import AdapterRegistry
    from kora_trainer.train_multi_lora import register_given

    registry = AdapterRegistry(cfg, Path(root) / "adapters" / "registry.json" if root else None)
    register_given(cfg, registry, registry.restore())
    return registry


def time_left(limit: float | None) -> Any:
    """A check the multi-adapter loop makes each round: False once --time-limit (less the shutdown) is spent."""
    return lambda: not limit or time.monotonic() - T_START + SHUTDOWN_S < limit


def trackers(cfg: TrainerConfig, run_dir: Path) -> list[Any] | None:
    """The trackers `tracking:` turns on (TensorBoard, W&B), started; None: one cannot start (the reason printed)."""
    from kora_trainer.tracking import TrackingError, open_sinks

    try:
        sinks = open_sinks(cfg.tracking, run_dir, cfg.model_dump(by_alias=True, mode="json"))
    except TrackingError as e:
        print(e, file=sys.stderr)
        return None
    for sink in sinks:
        print(f"tracking: {type(sink).__name__.removesuffix('Sink')} -> {sink.where}", flush=True)
    return sinks


def summarize(cfg: TrainerConfig, rec: StepRecorder, job: Job | None, loop: Any) -> None:
    """The summary line of a finished run: the multi-adapter loop's, a diffusion run's, or the single loop's."""
    if loop is not None:
        from kora_trainer.train_multi_lora import summary

        summary(loop, rec)
    elif cfg.diffusion is not None:
        rec.summary("colocated", "torch")
    else:
        rec.summary(job.transport if job else None, job.info.get("backend") if job else None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load(args)
    if cfg is None:
        return 2
    if args.dry_run:
        return dry_run(cfg, args)
    from kora_trainer.orchestration.sglang_launcher import installed_build_problem

    if (installed := installed_build_problem(cfg)) is not None:  # before anything starts: the image's SGLang
        print(f"invalid kora config:\n  rollout.sglangBuild: {installed}", file=sys.stderr)
        return 2
    from kora_trainer.control_plane import ControlPlane, resolve_linger, resolve_port, resolve_token
    from kora_trainer.orchestration.cluster import launch, shutdown, start_ray
    from kora_trainer.recorder import StepRecorder
    from kora_trainer.serving_check import ServingCheck

    run_dir = Path(args.run_dir or f".kora/runs/{time.strftime('%Y%m%d-%H%M%S')}")
    multi = cfg.multi_lora.max_adapters > 0
    serving = (ServingCheck(cfg.sync.served_logp_gap_max, cfg.sync.served_bad_steps_to_fail) if cfg.diffusion is None
               else ServingCheck(cfg.diffusion.served_logp_gap_max, cfg.sync.served_bad_steps_to_fail,
                                 field="diffusion.servedLogpGapMax"))
    sinks = trackers(cfg, run_dir)
    if sinks is None:
        return 2
    rec = StepRecorder(run_dir, 0 if multi else total_steps(cfg), str(cfg.lora.effective_sync_mode), T_START,
                       serving=None if multi else serving, sinks=sinks)
    root = str(Path(cfg.checkpoint.path).resolve()) if cfg.checkpoint.path else None  # workers need not share cwd
    linger_s, linger_warning = resolve_linger()
    if linger_warning:
        rec.say(f"warning: {linger_warning}")
    token, token_from = resolve_token(run_dir)
    routes = registry = None
    if multi:
        from kora_trainer.adapter_runs.api import AdapterRunsAPI
        from kora_trainer.adapter_runs.registry import RegistryError

        try:
            registry = adapter_registry(cfg, root)
        except RegistryError as e:  # an adapter of multiLora.adapters the registry refuses (e.g. its data file)
            print(f"multiLora.adapters: {e.message}", file=sys.stderr)
            rec.close()
            return 2
        routes = AdapterRunsAPI(registry)
    control = ControlPlane(rec.progress, token, resolve_port(args.control_port), routes=routes).start()
    rec.say(f"control plane {control.url}/status (bearer token: {token_from}); run dir {run_dir}")
    started_ray, temp_dir, job, ok, loop = False, None, None, False, None
    try:
        if cfg.diffusion is not None:  # its engine, and this process or Ray ranks (train_diffusion.py)
            from kora_trainer.train_diffusion import run as run_diffusion

            run_diffusion(cfg, rec, root, time_left(args.time_limit), run_dir, threads=args.threads)
        else:
            started_ray, temp_dir = start_ray()  # imports Ray, after setting the environment Ray reads at import
            job = launch(cfg, run_dir, threads=args.threads)
            if registry is not None:
                from kora_trainer.train_multi_lora import run

                loop = run(job, cfg, registry, rec, root, time_left(args.time_limit))
            else:
                train(job, cfg, rec, root, args.time_limit)
        rec.progress.update(phase="Succeeded")
        ok = True
    except BaseException as e:
        rec.failed(e)
        raise
    finally:
        if cfg.diffusion is None:
            shutdown(job, started_ray, temp_dir)
        if ok:
            summarize(cfg, rec, job, loop)
        rec.close()
        if linger_s > 0:
            rec.say(f"control plane: serving the final status for up to {linger_s:g}s")
            read = control.linger(linger_s)
            rec.say(f"control plane: final status {'read' if read else 'not read'}; stopping")
        control.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
