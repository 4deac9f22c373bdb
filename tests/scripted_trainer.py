"""A stand-in for `python -m kora_trainer.train` in runtime-Ray tests: the operator submits it (its
--trainer-command) to a real Ray head exactly as it would the trainer, and it does what the test
wrote in `<model.path>/script.json` instead of training, so the operator's side is tested without
depending on the trainer's speed or state.

    {"mode": "sleep"}                        run until stopped
    {"mode": "exit", "code": 3, "say": "…"}  print `say` to stderr and exit `code`
    {"mode": "serve", "steps": 3}            the REAL control plane (kora_trainer.control_plane) with the
                                             token and port from the environment, as the trainer
                                             would; one step per 0.5 s; stays up `linger` s at the end
    {"mode": "multi", "num_steps": 4}        a multi-adapter service (multiLora.maxAdapters from the config): the
                                             REAL control plane with the REAL adapter registry and /adapter_runs
                                             routes (kora_trainer.adapter_runs), and a scripted stand-in for the
                                             trainer's multi-adapter driver (see `multi`); runs until stopped
    "fail_attempts": N                       the first N runs exit 1 (a crash), later ones do `mode`
Every run appends its pid to `<model.path>/pids`, and writes the config it read and the KORA_*
environment it got to `<model.path>/attempt-<n>.json`. With checkpoint.path set, "serve" resumes
from `<checkpoint.path>/step` and writes it after every step, as the trainer's LoRA-only
checkpoint would, and appends each step it trains to `<model.path>/steps`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", required=True)
    args = p.parse_args()
    text = Path(args.config).read_text()
    cfg = yaml.safe_load(text)
    home = Path(cfg["model"]["path"])
    script = json.loads((home / "script.json").read_text())
    with open(home / "pids", "a") as fh:
        fh.write(f"{os.getpid()}\n")
    attempt = len((home / "pids").read_text().split())
    env = {k: v for k, v in os.environ.items() if k.startswith("KORA_") and k != "KORA_LOCAL_RAY"}
    (home / f"attempt-{attempt}.json").write_text(json.dumps({"config": text, "env": env, "run_dir": args.run_dir,
                                                               "cwd": os.getcwd()}))
    if attempt <= script.get("fail_attempts", 0):
        print(f"RuntimeError: scripted crash of attempt {attempt}", file=sys.stderr, flush=True)
        return 1
    mode = script.get("mode", "sleep")
    if mode == "exit":
        print("starting", flush=True)
        print(script.get("say", "scripted failure"), file=sys.stderr, flush=True)
        return int(script.get("code", 1))
    if mode == "serve":
        return serve(cfg, script, home)
    if mode == "multi":
        return multi(cfg, script)
    while True:
        time.sleep(1)


def serve(cfg: dict, script: dict, home: Path) -> int:
    from kora_trainer.control_plane import ControlPlane, Progress, resolve_port, resolve_token

    steps = int(script.get("steps", 3))
    progress = Progress(steps, cfg.get("lora", {}).get("syncMode") or "Merge")
    token, _ = resolve_token(Path("."))
    control = ControlPlane(progress, token, resolve_port(None)).start()
    ckpt = Path(cfg["checkpoint"]["path"]) if (cfg.get("checkpoint") or {}).get("path") else None
    start = int((ckpt / "step").read_text()) if ckpt and (ckpt / "step").exists() else 0
    try:
        progress.update(phase="Running", step=start)
        for step in range(start + 1, steps + 1):
            time.sleep(float(script.get("step_seconds", 0.5)))
            progress.record_sync({"mode": "Merge", "bytes": 1000 * step, "ms": 1.5, "adapter_version": step,
                                  "checksum": f"c{step}", "pushed": True})
            progress.update(step=step, rewardMean=step / steps)
            with open(home / "steps", "a") as fh:
                fh.write(f"{step}\n")
            if ckpt:
                ckpt.mkdir(parents=True, exist_ok=True)
                (ckpt / "step").write_text(str(step))
                progress.update(lastCheckpoint={"path": str(ckpt), "step": step})
            if step == script.get("crash_at_step"):
                print(f"RuntimeError: scripted crash at step {step}", file=sys.stderr, flush=True)
                return 1
        progress.update(phase="Succeeded")
        time.sleep(float(script.get("linger", 0)))
    finally:
        control.stop()
    return 0


def multi(cfg: dict, script: dict) -> int:
    """A stand-in for the trainer's multi-adapter driver (which trains each adapter on the GPUs): every
    `step_seconds` (default 0.5), at its step boundary, it does what the driver does with the registry, without
    any training: retires what `registry.to_retire()` names (DELETE, or numSteps reached: `finished`, with an
    export path), loads what `registry.to_load()` names (its numSteps, or `num_steps` when it gives none), and
    steps every active adapter once (`stepped` with reward step / numSteps, `synced` at that version). The
    registry, the routes, the control plane and its token are the trainer's own."""
    from kora_trainer.adapter_runs.api import AdapterRunsAPI
    from kora_trainer.adapter_runs.registry import AdapterRegistry
    from kora_trainer.config import TrainerConfig
    from kora_trainer.control_plane import ControlPlane, Progress, resolve_port, resolve_token
    from kora_trainer.sync import sender  # noqa: F401  (the registry imports it, with torch, at the first POST)

    registry = AdapterRegistry(TrainerConfig.model_validate(cfg))
    progress = Progress(0, "Adapter")
    token, _ = resolve_token(Path("."))
    control = ControlPlane(progress, token, resolve_port(None), routes=AdapterRunsAPI(registry)).start()
    default_steps = int(script.get("num_steps", 4))
    steps = 0
    try:
        progress.update(phase="Running")
        while True:
            time.sleep(float(script.get("step_seconds", 0.5)))
            for name, phase in registry.to_retire():
                registry.finished(name, phase, f"{phase.lower()} at step {registry.get(name).step}",
                                  export_path=f"/exports/{name}")
            for adapter in registry.to_load():
                registry.loaded(adapter.name, adapter.num_steps or default_steps)
            active = registry.active_names()
            for name in active:
                run = registry.get(name)
                step = run.step + 1
                registry.stepped(name, step, step / (run.num_steps or default_steps))
                registry.synced(name, step, {"mode": "Adapter", "bytes": 100 * step, "ms": 1.0,
                                             "checksum": f"{name}-{step}"})
            steps += bool(active)
            progress.update(step=steps)
    finally:
        control.stop()


if __name__ == "__main__":
    raise SystemExit(main())
