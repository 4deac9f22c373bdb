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

At the end the control plane lingers for the operator: until one authorized GET /status has returned
the final phase, or KORA_CONTROL_LINGER_S seconds (default 0) passed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kora_trainer.config import TrainerConfig

T_START = time.monotonic()  # the whole command's wall time counts, Ray start included
SHUTDOWN_S = 5.0  # stopping the engines and Ray, kept in reserve by --time-limit


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from kora_trainer.config.flags import add_seed_flags

    p = argparse.ArgumentParser(prog="python -m kora_trainer.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="job YAML: a trainer spec or a whole LoRATrainingJob")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. lora.syncMode=Adapter")
    p.add_argument("--run-dir", default=None, help="logs and the control-plane token (default .kora/runs/<time>)")
    p.add_argument("--control-port", type=int, default=None, help="control-plane port (default $KORA_CONTROL_PORT "
                   "or 8068; 0 picks a free one)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop after the last step that fits in this wall time (the summary says how many ran)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1: see orchestration/"
                   "cluster.py for why)")
    add_seed_flags(p)
    return p.parse_args(argv)


def total_steps(cfg: TrainerConfig) -> int:
    alg = cfg.algorithm
    if alg.num_steps is not None:
        return int(alg.num_steps)
    from kora_trainer.orchestration.data import load_rows

    rows = len(load_rows(cfg.data.path, cfg.data.input_key, cfg.data.label_key))
    return max(1, (alg.num_epochs or 1) * rows // alg.rollout_batch_size)


def progress_line(step: int, steps: int, metrics: dict[str, Any], rstats: dict[str, Any],
                  report: dict[str, Any]) -> str:
    sync = f"{report['ms']:.0f}ms {report['bytes']}B v{report['adapter_version']}" if report["pushed"] else "skipped"
    g = metrics["rollout_logp_gap_max"]
    gap = f"gap {g:.0e}" if g is not None else f"lag {metrics['rollout_version_lag']}"
    return (f"step {step}/{steps} reward {metrics['reward_mean']:.3f} loss {metrics['loss']:.6g} | "
            f"gen {rstats['gen_ms'] / 1000:.2f}s "
            f"train {metrics['train_ms'] / 1000:.2f}s clip {metrics['clip_frac']:.3f} "
            f"{gap} | sync {sync} | {time.monotonic() - T_START:.0f}s")


@dataclass
class Run:
    """What this process did: per-step curves, syncs, and where it started / checkpointed."""

    start: int = 0  # the step resumed from (0: a fresh start); the first step run is start + 1
    resumed: bool = False
    data_position: int = 0  # prompt batches taken for the steps done so far
    rewards: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)  # policy versions each step's rollouts lagged the trainer
    # per step: max |trainer log-prob - engine log-prob| of the sampled tokens before the first update (0 up to
    # kernel noise when the engines serve exactly the policy the trainer holds: the sync is right)
    logp_gaps: list[float | None] = field(default_factory=list)  # None: rollouts of an older version (async)
    syncs: list[dict[str, Any]] = field(default_factory=list)
    saved_step: int | None = None  # the newest checkpoint's step
    export: str | None = None

    @property
    def done(self) -> int:  # the last step whose update is applied
        return self.start + len(self.rewards)


def resume(job: Any, cfg: TrainerConfig, root: str, progress: Any, run: Run) -> None:
    """SPEC rule 8, then the newest checkpoint under root that verifies (newer refused ones are logged)."""
    import ray

    if cfg.checkpoint.lora_only:
        ray.get(job.trainer.check_lora_only.remote())
    info = ray.get(job.trainer.resume.remote(root))
    if info is None:
        print(f"no checkpoint under {root}: starting at step 1", flush=True)
        return
    for reason in info["skipped"]:
        print(f"checkpoint refused, falling back to an older one: {reason}", flush=True)
    run.start, run.resumed, run.saved_step = info["step"], True, info["step"]
    run.data_position = ray.get(job.rollout.skip_to.remote(info["data_position"]))
    print(f"resumed from checkpoint step {info['step']} ({info['path']})", flush=True)
    progress.update(resumedFromStep=info["step"], step=info["step"],
                    lastCheckpoint={"path": info["path"], "step": info["step"]})


def save_checkpoint(job: Any, cfg: TrainerConfig, root: str, step: int, progress: Any, run: Run) -> None:
    import ray

    t0 = time.monotonic()
    meta = {"sync_mode": str(cfg.lora.effective_sync_mode), "base_model": str(Path(cfg.model.path).resolve()),
            "seed": cfg.algorithm.seed, "async": cfg.deployment.async_}
    path = ray.get(job.trainer.save_checkpoint.remote(root, run.data_position, cfg.checkpoint.keep, meta))
    run.saved_step = step
    progress.update(lastCheckpoint={"path": path, "step": step})
    print(f"checkpoint step {step} -> {path} ({(time.monotonic() - t0) * 1000:.0f} ms)", flush=True)


def sync_paths(pushed: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pushes and their median ms per sync path (http: the engine routes per bucket; fast: sync/fast_sender.py)."""
    out = {}
    for path in dict.fromkeys(s.get("path", "http") for s in pushed):
        ms = [s["ms"] for s in pushed if s.get("path", "http") == path]
        out[path] = {"pushes": len(ms), "ms_p50": round(statistics.median(ms), 2)}
    return out


def make_summary(run: Run, mode: str, job: Any, progress: Any) -> dict[str, Any]:
    pushed = [s for s in run.syncs if s["pushed"]]
    rewards = run.rewards
    return {
        "event": "summary", "steps": len(rewards), "first_step": run.start + 1,
        "resumed_from_step": run.start if run.resumed else None,
        "sync_mode": mode, "transport": job.transport if job else None,
        "backend": job.info.get("backend") if job else None,
        "reward_first": round(statistics.fmean(rewards[:10]), 4) if rewards else None,
        "reward_last": round(statistics.fmean(rewards[-10:]), 4) if rewards else None,
        "sync_ms_p50": round(statistics.median(s["ms"] for s in pushed), 2) if pushed else None,
        "sync_paths": sync_paths(pushed),
        "sync_bytes_per_step": round(statistics.fmean(s["bytes"] for s in run.syncs)) if run.syncs else 0,
        "syncs_skipped": len(run.syncs) - len(pushed),
        "rollout_lag_max": max(run.lags, default=0),
        "rollout_logp_gap_max": max((g for g in run.logp_gaps if g is not None), default=None),
        "wall_s": round(time.monotonic() - T_START, 1),
        "reward_curve": [round(r, 3) for r in rewards],
        "loss_curve": run.losses,  # unrounded: a resumed run's tail is compared with the uninterrupted one
        "last_checkpoint": progress.snapshot()["lastCheckpoint"], "export": run.export,
    }


def main(argv: list[str] | None = None) -> int:
    from kora_trainer.config import ConfigError, load_config
    from kora_trainer.config.flags import as_overrides, seed_flag_values

    args = parse_args(argv)
    try:
        cfg, warnings = load_config(args.config, [*args.overrides, *as_overrides(seed_flag_values(args))])
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    for w in warnings:
        print(f"warning: {w.message}", flush=True)
    run_dir = Path(args.run_dir or f".kora/runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if not Path(cfg.model.path).exists() and Path(cfg.model.path).name == "toy":
        from kora_trainer.toy import make_toy  # the toy is made on first use, like a dataset download

        print(f"making the toy model and dataset in {cfg.model.path} (kora make-toy)", flush=True)
        make_toy(cfg.model.path, threads=args.threads)

    from kora_trainer.control_plane import ControlPlane, Progress, resolve_linger, resolve_port, resolve_token
    from kora_trainer.orchestration.cluster import launch, shutdown, start_ray

    steps, mode = total_steps(cfg), str(cfg.lora.effective_sync_mode)
    ck = cfg.checkpoint
    root = str(Path(ck.path).resolve()) if ck.path else None  # absolute: the workers need not share our cwd
    linger_s, linger_warning = resolve_linger()
    if linger_warning:
        print(f"warning: {linger_warning}", flush=True)
    progress = Progress(steps, mode)
    token, token_from = resolve_token(run_dir)
    control = ControlPlane(progress, token, resolve_port(args.control_port)).start()
    print(f"control plane {control.url}/status (bearer token: {token_from}); run dir {run_dir}", flush=True)
    started_ray, temp_dir, job = False, None, None
    run, ok = Run(), False
    try:
        started_ray, temp_dir = start_ray()  # imports Ray, after setting the environment Ray reads at import
        import ray

        job = launch(cfg, run_dir, threads=args.threads)
        if root:
            resume(job, cfg, root, progress, run)
        first = ray.get(job.trainer.sync.remote())  # the engines serve the initial (or the restored) policy
        progress.record_sync(first, step=run.start)
        progress.update(phase="Running")
        print(f"ready in {time.monotonic() - T_START:.1f}s: {job.info['backend']} on {job.info['device']}, "
              f"{len(job.engines)} {cfg.rollout.engine} engine(s), "
              f"sync {mode} over {job.transport}, first push {first['bytes']} B in {first['ms']:.0f} ms", flush=True)
        if first.get("note"):
            print(f"sync: {first['note']}", flush=True)
        # deployment.async: the engines generate ahead while the trainer trains, up to maxStaleness steps ahead,
        # so a rollout lags the policy by at most that many versions (the clipped ratio against the engines' own
        # log-probs corrects for it). Generations are queued on the one rollout actor, which runs them in order.
        ahead = cfg.deployment.max_staleness if cfg.deployment.async_ else 0
        gen = job.rollout.generate.options(num_returns=2)
        queue: deque[Any] = deque()  # (batch, stats) refs: a batch goes to the trainer without visiting the driver
        issued = run.start  # the last step whose generation is queued

        def issue_through(last: int) -> None:
            nonlocal issued
            while issued < min(last, steps):
                issued += 1
                queue.append(gen.remote(issued))

        issue_through(run.start + 1)
        last_step_s = 0.0
        for step in range(run.start + 1, steps + 1):
            if args.time_limit and time.monotonic() - T_START + last_step_s + SHUTDOWN_S > args.time_limit:
                print(f"time limit {args.time_limit:.0f}s: stopping after step {step - 1}", flush=True)
                break
            t_step = time.monotonic()
            batch_ref, stats_ref = queue.popleft()  # issued before the loop or during an earlier step
            metrics_ref = job.trainer.train_step.remote(batch_ref)
            issue_through(step + ahead)
            metrics, rstats = ray.get([metrics_ref, stats_ref])
            report = ray.get(job.trainer.sync.remote())
            run.rewards.append(metrics["reward_mean"])
            run.losses.append(metrics["loss"])
            run.lags.append(metrics["rollout_version_lag"])
            run.logp_gaps.append(metrics["rollout_logp_gap_max"])
            run.syncs.append(report)
            run.data_position = rstats["data_position"]
            progress.record_sync(report, step=step)
            progress.update(step=step, rewardMean=metrics["reward_mean"])
            print(progress_line(step, steps, metrics, rstats, report), flush=True)
            if report.get("note"):
                print(f"sync: {report['note']}", flush=True)
            issue_through(step + 1)  # (not async) the engines generate while the trainer writes the checkpoint
            if root and (step % ck.interval == 0 or step == steps):
                save_checkpoint(job, cfg, root, step, progress, run)
            last_step_s = time.monotonic() - t_step
        if root and run.rewards and run.done != run.saved_step:  # stopped early (time limit): keep the last step
            save_checkpoint(job, cfg, root, run.done, progress, run)
        if root and ck.export_hf:
            run.export = ray.get(job.trainer.export_hf.remote(root, {"seed": cfg.algorithm.seed}))
            print(f"exported the adapter (HF-PEFT, step {run.done}) -> {run.export}", flush=True)
        progress.update(phase="Succeeded")
        ok = True
    except BaseException as e:
        cause = getattr(e, "cause", None)  # a worker's error arrives wrapped in a RayTaskError
        shown = cause if isinstance(cause, BaseException) else e
        progress.update(phase="Failed", message=f"{type(shown).__name__}: {shown}")  # TrainerStatus caps it
        raise
    finally:
        shutdown(job, started_ray, temp_dir)
        if ok:
            print(json.dumps(make_summary(run, mode, job, progress)), flush=True)
        if linger_s > 0:
            print(f"control plane: serving the final status for up to {linger_s:g}s", flush=True)
            read = control.linger(linger_s)
            print(f"control plane: final status {'read' if read else 'not read'}; stopping", flush=True)
        control.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
