"""`python -m kora_trainer.train --config FILE [key=value ...] [seed flags]`: one LoRA GRPO job.

The loop, top to bottom: start Ray and the workers (engines, trainer, rollout manager), push the initial
policy, then per step generate -> score -> GRPO update -> sync, publishing progress on the control plane.
With `deployment.async` the next step's rollouts are generated while the current step trains (one policy
version of staleness). It ends with one JSON line: {"event": "summary", "steps", "sync_mode",
"reward_first", "reward_last", ...} (reward_first / reward_last: mean training reward over the first /
last 10 steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
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
    return (f"step {step}/{steps} reward {metrics['reward_mean']:.3f} | gen {rstats['gen_ms'] / 1000:.2f}s "
            f"train {metrics['train_ms'] / 1000:.2f}s clip {metrics['clip_frac']:.3f} "
            f"{gap} | sync {sync} | {time.monotonic() - T_START:.0f}s")


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

    from kora_trainer.control_plane import ControlPlane, Progress, resolve_port, resolve_token
    from kora_trainer.orchestration.cluster import launch, shutdown, start_ray

    steps, mode = total_steps(cfg), str(cfg.lora.effective_sync_mode)
    progress = Progress(steps, mode)
    token, token_from = resolve_token(run_dir)
    control = ControlPlane(progress, token, resolve_port(args.control_port)).start()
    print(f"control plane {control.url}/status (bearer token: {token_from}); run dir {run_dir}", flush=True)
    started_ray, temp_dir, job = False, None, None
    rewards: list[float] = []
    syncs: list[dict[str, Any]] = []
    try:
        import ray

        started_ray, temp_dir = start_ray()
        job = launch(cfg, run_dir, threads=args.threads)
        first = ray.get(job.trainer.sync.remote())  # step 0: the engines serve the initial policy
        progress.record_sync(first, step=0)
        progress.update(phase="Running")
        print(f"ready in {time.monotonic() - T_START:.1f}s: {len(job.engines)} {cfg.rollout.engine} engine(s), "
              f"sync {mode} over {job.transport}, first push {first['bytes']} B in {first['ms']:.0f} ms", flush=True)
        # deployment.async: the engines generate step t+1 while the trainer trains step t, so rollouts lag
        # the policy by one version (the clipped ratio against the engines' own log-probs corrects for it)
        overlap = cfg.deployment.async_
        gen = job.rollout.generate.options(num_returns=2)
        pending = gen.remote(1)  # (batch, stats): the batch goes to the trainer without visiting the driver
        last_step_s = 0.0
        for step in range(1, steps + 1):
            if args.time_limit and time.monotonic() - T_START + last_step_s + SHUTDOWN_S > args.time_limit:
                print(f"time limit {args.time_limit:.0f}s: stopping after step {step - 1}", flush=True)
                break
            t_step = time.monotonic()
            batch_ref, stats_ref = pending
            metrics_ref = job.trainer.train_step.remote(batch_ref)
            if overlap and step < steps:
                pending = gen.remote(step + 1)
            metrics, rstats = ray.get([metrics_ref, stats_ref])
            report = ray.get(job.trainer.sync.remote())
            if not overlap and step < steps:
                pending = gen.remote(step + 1)
            rewards.append(metrics["reward_mean"])
            syncs.append(report)
            progress.record_sync(report, step=step)
            progress.update(step=step, rewardMean=metrics["reward_mean"])
            print(progress_line(step, steps, metrics, rstats, report), flush=True)
            last_step_s = time.monotonic() - t_step
        progress.update(phase="Succeeded")
    except BaseException as e:
        progress.update(phase="Failed", message=f"{type(e).__name__}: {e}"[:1000])
        raise
    finally:
        shutdown(job, started_ray, temp_dir)
        control.stop()
    pushed = [s for s in syncs if s["pushed"]]
    summary = {
        "event": "summary", "steps": len(rewards), "sync_mode": mode, "transport": job.transport if job else None,
        "reward_first": round(statistics.fmean(rewards[:10]), 4) if rewards else None,
        "reward_last": round(statistics.fmean(rewards[-10:]), 4) if rewards else None,
        "sync_ms_p50": round(statistics.median(s["ms"] for s in pushed), 2) if pushed else None,
        "sync_bytes_per_step": round(statistics.fmean(s["bytes"] for s in syncs)) if syncs else 0,
        "syncs_skipped": len(syncs) - len(pushed),
        "wall_s": round(time.monotonic() - T_START, 1),
        "reward_curve": [round(r, 3) for r in rewards],
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
