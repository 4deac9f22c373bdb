"""`python -m kora_trainer.train --config FILE [key=value ...] [seed flags]`: one LoRA GRPO job.

The entry: read the job's config (with --make-toy, the toy made at model.path first), print the placement
(--dry-run), pick the job's recipe once (recipes/: grpo.py, the default; multi_lora.py for multiLora.maxAdapters >
0; flow_grpo.py for a `diffusion` section), then run it behind the step recorder and the control plane. What a
recipe's loop does, resume included, its module's docstring says (recipes/grpo.py for the default job).

Everything a run records goes through recorder.StepRecorder: stdout, the control plane's progress, and the
JSON-lines event file `<run dir>/events.jsonl` (one event per step, sync, checkpoint, and the summary; the
recorder's docstring lists them).

At the end the control plane lingers for the operator: until one authorized GET /status has returned
the final phase, or KORA_CONTROL_LINGER_S seconds (default 0) passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kora_trainer.backends.megatron import megatron_available
from kora_trainer.backends.select import check_actor_layout, resolve_backend, weights_bytes
from kora_trainer.config import ConfigError, TrainerConfig, load_config, read_hf_config
from kora_trainer.config.flags import add_seed_flags, as_overrides, origins, seed_flag_values
from kora_trainer.config.placement import Node, parse_nodes, plan_job
from kora_trainer.config.start_layout import config_experts
from kora_trainer.control_plane import ControlPlane, resolve_linger, resolve_port, resolve_token
from kora_trainer.orchestration.sglang_launcher import installed_build_problem
from kora_trainer.recipes import Clock, Recipe, RecipeRefused, recipe_for
from kora_trainer.recorder import StepRecorder
from kora_trainer.tracking import TrackingError, open_sinks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    try:
        if args.nodes:  # a cluster elsewhere: assume its image has megatron-core where it has GPUs
            nodes = parse_nodes(args.nodes)
            megatron = any(n.gpus for n in nodes)
        else:
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


def load(args: argparse.Namespace) -> TrainerConfig | None:
    """The job's config with its overrides and seed flags (None: refused, the reason printed); nothing at
    model.path is refused unless --make-toy (the recipe makes its toy there) or --dry-run (a plan needs no model)."""
    try:
        flags = seed_flag_values(args)
        cfg, warnings = load_config(args.config, [*args.overrides, *as_overrides(flags)], origins=origins(flags))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return None
    for w in warnings:
        print(f"warning: {w.message}", flush=True)
    if not args.dry_run and not args.make_toy and not Path(cfg.model.path).exists():
        print(f"model.path {cfg.model.path} does not exist: point model.path at an HF checkpoint directory, or "
              "pass --make-toy to make the toy model and dataset there", file=sys.stderr)
        return None
    if not args.dry_run and not args.make_toy and not Path(cfg.data.path).exists():  # else a Ray actor dies on it
        print(f"data.path {cfg.data.path} does not exist: point data.path at a .parquet or .jsonl file of prompts "
              f"(columns data.inputKey, data.labelKey), or pass --make-toy to make the toy dataset there",
              file=sys.stderr)
        return None
    return cfg


def trackers(cfg: TrainerConfig, run_dir: Path) -> list[Any] | None:
    """The trackers `tracking:` turns on (TensorBoard, W&B), started; None: one cannot start (the reason printed)."""
    try:
        sinks = open_sinks(cfg.tracking, run_dir, cfg.model_dump(by_alias=True, mode="json"))
    except TrackingError as e:
        print(e, file=sys.stderr)
        return None
    for sink in sinks:
        print(f"tracking: {type(sink).__name__.removesuffix('Sink')} -> {sink.where}", flush=True)
    return sinks


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()  # the whole command's wall time counts, Ray start included
    args = parse_args(argv)
    cfg = load(args)
    if cfg is None:
        return 2
    if args.dry_run:
        return dry_run(cfg, args)
    clock = Clock(args.time_limit, start)
    recipe = recipe_for(cfg, clock, args.threads)
    if not Path(cfg.model.path).exists():  # with --make-toy (load refused it without)
        recipe.make_toy()

    if (installed := installed_build_problem(cfg)) is not None:  # before anything starts: the image's SGLang
        print(f"invalid kora config:\n  rollout.sglangBuild: {installed}", file=sys.stderr)
        return 2
    return serve(recipe, cfg, args, clock)


def serve(recipe: Recipe, cfg: TrainerConfig, args: argparse.Namespace, clock: Clock) -> int:
    """The recipe's run behind the step recorder and the control plane (which lingers for the operator after)."""
    run_dir = Path(args.run_dir or f".kora/runs/{time.strftime('%Y%m%d-%H%M%S')}")
    serving = recipe.serving_check()
    sinks = trackers(cfg, run_dir)
    if sinks is None:
        return 2
    rec = StepRecorder(run_dir, recipe.total_steps(), str(cfg.lora.effective_sync_mode), clock.start,
                       serving=serving, sinks=sinks)
    root = str(Path(cfg.checkpoint.path).resolve()) if cfg.checkpoint.path else None  # workers need not share cwd
    linger_s, linger_warning = resolve_linger()
    if linger_warning:
        rec.say(f"warning: {linger_warning}")
    token, token_from = resolve_token(run_dir)
    try:
        routes = recipe.control_routes(root)
    except RecipeRefused as e:
        print(e, file=sys.stderr)
        rec.close()
        return 2
    control = ControlPlane(rec.progress, token, resolve_port(args.control_port), routes=routes).start()
    rec.say(f"control plane {control.url}/status (bearer token: {token_from}); run dir {run_dir}")
    try:
        run(recipe, rec, root, run_dir)
    finally:
        if linger_s > 0:
            rec.say(f"control plane: serving the final status for up to {linger_s:g}s")
            read = control.linger(linger_s)
            rec.say(f"control plane: final status {'read' if read else 'not read'}; stopping")
        control.stop()
    return 0


def run(recipe: Recipe, rec: StepRecorder, root: str | None, run_dir: Path) -> None:
    """Train; then, whatever happened, stop what the recipe started, summarize a success and close the record."""
    ok = False
    try:
        recipe.train(rec, root, run_dir)
        rec.progress.update(phase="Succeeded")
        ok = True
    except BaseException as e:
        rec.failed(e)
        raise
    finally:
        recipe.close()
        if ok:
            recipe.summarize(rec)
        rec.close()


if __name__ == "__main__":
    raise SystemExit(main())
