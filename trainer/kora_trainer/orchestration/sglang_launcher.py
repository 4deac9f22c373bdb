"""Command lines that start a rollout engine for a TrainerConfig: a real SGLang server
(`python -m sglang.launch_server`, pinned to sglang 0.5.23) or kora's reference engine
(`python -m kora_engine.lm`). Both speak the same HTTP API, so the trainer starts
either with `engine_command(config, ...)` and talks to it with `rollout.client.EngineClient`.

The SGLang flag names were checked against SGLang's `docs/advanced_features/server_arguments.md`
(search index, commit 004813e1; the flags used here are long-standing ones also listed in
`python/sglang/srt/server_args.py`): `--model-path`, `--host`, `--port`, `--tp-size`, `--dp-size`,
`--enable-lora`, `--max-loras-per-batch` ("including base-only requests"), `--max-lora-rank`,
`--lora-target-modules` (a list; SGLang's names), `--mem-fraction-static`, `--enable-memory-saver`,
`--disable-radix-cache`, `--api-key`, `--admin-api-key`, `--base-gpu-id`, `--random-seed`,
`--enable-deterministic-inference` (docs/advanced_features/deterministic_inference.md).

How the config maps onto them:
- Merge mode: the engine serves a plain model (the trainer pushes merged weights): no LoRA flags.
- Adapter mode: `--enable-lora`, rank and target modules from `lora` (Megatron names through
  MEGATRON_TO_SGLANG), two adapter slots per batch (`kora-policy` plus base-only requests such as
  the health probe) or `multiLora.maxAdapters + 1`. The adapter is replaced under one name every
  step, so `--disable-radix-cache`: a cached prefix computed with the previous adapter must not be
  reused (the adapter routes, unlike the weight routes, do not flush the cache).
- EngineMerge: needs the engine-side fold (`weight_update_mode: "lora_merge"`), which SGLang 0.5.23's
  LLM server does not have — only kora's hf engine (see kora_engine/lm/server.py) — so it is refused for sglang.
- Colocate: training and rollout share the GPUs: `--mem-fraction-static` (default 0.5 here; SGLang's
  own default fills the GPU) and `--enable-memory-saver` (release/resume memory occupation).
- Reproducible rollouts: for a run that claims exact resume (`reproducible_rollouts`: checkpoint.path
  set, deployment.async false) the rollout manager sends every sample as its own request with its own
  `sampling_seed` (orchestration/rollout_manager.py). SGLang reads that seed only with
  `--enable-deterministic-inference`: `SamplingBatchInfo` builds its per-request seed tensor only when
  the server flag is on (else the sampler draws from its global RNG and the seed has no effect), and the
  flag also switches to batch-invariant kernels, the pytorch sampling backend and an attention backend
  that supports them (fa3 / triton; flashinfer loses the radix cache), so a sample does not depend on
  what else is in the batch. It costs throughput (SGLang's blog: about a third with CUDA graphs), so it
  is added only for such runs, or when asked (`deterministic=True`).

Keys (`api_key`, `admin_api_key`: SGLang's `--api-key` / `--admin-api-key`, wire/engine_auth.py's rules)
never go into argv, which `ps` shows every user of the machine. The reference engine reads them from its
environment (`EngineLaunch.env`: KORA_ENGINE_API_KEY / KORA_ENGINE_ADMIN_API_KEY). SGLang reads no key
from the environment (its ServerArgs fields `api_key` / `admin_api_key` come from flags only), but
`sglang.launch_server --config FILE.yaml` (`prepare_server_args` → `ConfigArgumentMerger`) turns a
YAML file's `flag-name: value` pairs into flags inside the process: the keys go into such a file
(`EngineLaunch.secret_files`, mode 0600, removed once the engine is healthy) and argv names only its
path. ⚠ SGLang logs `server_args=ServerArgs(...)` at INFO level when it starts, keys included: its log
file is as secret as the key.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from kora_trainer.config import MEGATRON_TO_SGLANG, DeploymentMode, SyncMode, TrainerConfig
from kora_trainer.config.sections import Engine
from kora_trainer.config.sglang_builds import BUILDS, DEFAULT_BUILD, MILES_COMMIT, Build, effective_build
from kora_trainer.wire.engine_auth import ADMIN_API_KEY_ENV, API_KEY_ENV

SGLANG_VERSION = "0.5.23"
SGLANG_REQUIREMENT = f"sglang=={SGLANG_VERSION}"
COLOCATE_MEM_FRACTION = 0.5


class UnsupportedEngineConfig(ValueError):
    """The config asks for something the chosen engine cannot do."""


@dataclass(frozen=True)
class EngineLaunch:
    """argv + environment for one engine process, and where it will listen. `secret_files` (path ->
    contents) must exist, readable by the owner only, before the process starts: SGLang reads its keys
    from one (see "Keys" above); whoever runs the launch writes them and removes them once it is up."""

    argv: list[str]
    host: str
    port: int
    engine: str
    env: dict[str, str] = field(default_factory=dict)
    secret_files: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def sync_mode(config: TrainerConfig) -> SyncMode:
    return config.lora.sync_mode or SyncMode.MERGE


def lora_enabled(config: TrainerConfig) -> bool:
    return sync_mode(config) == SyncMode.ADAPTER or config.multi_lora.on


def sglang_target_modules(config: TrainerConfig) -> list[str]:
    out: list[str] = []
    for target in config.lora.target_modules:
        out.extend(m for m in MEGATRON_TO_SGLANG[target] if m not in out)
    return out


def reproducible_rollouts(config: TrainerConfig) -> bool:
    """The run resumes from checkpoints with exact replay (see the module docstring)."""
    return config.checkpoint.path is not None and not config.deployment.async_


def max_loras_per_batch(config: TrainerConfig) -> int:
    """Adapters per batch, base-only requests counting as one (SGLang's definition)."""
    return (config.multi_lora.slots or 1) + 1


def sglang_build_problem(build: Build, installed: str | None = None) -> str | None:
    """None when the installed sglang is `build` (the job's rollout.sglangBuild, or the pin); otherwise what is wrong
    and the fix. Stock builds by their version; a branch build by the git hash setuptools-scm puts in its local
    version (`0.5.x.devN+g<hash>[.dYYYYMMDD]`, python/pyproject.toml [tool.setuptools_scm] @ 94949da7) ⚠ not
    checked against an installed branch build. `installed` (default: the installed distribution's) is for tests."""
    image = f"the trainer image built with --build-arg SGLANG_BUILD={build.name.value}"
    if installed is None:
        try:
            installed = metadata.version("sglang")
        except metadata.PackageNotFoundError:
            return f"sglang is not installed: install {build.pip_requirement} ({image})"
    if build.stock_version is not None:
        if installed == build.stock_version:
            return None
    else:
        local = installed.partition("+")[2].split(".")
        if any(p.startswith("g") and len(p) >= 8 and MILES_COMMIT.startswith(p[1:]) for p in local):
            return None
    return (f"sglang {installed} is installed but the job names rollout.sglangBuild {build.name.value} (its routes "
            f"decide what the trainer sends): install {build.pip_requirement} ({image}), or set "
            f"rollout.sglangBuild to the build installed")


def installed_build_problem(config: TrainerConfig) -> str | None:
    """For rollout.engine sglang: what is wrong with the installed SGLang for the job's build (None: it is that
    build). The reference engine (engine hf) needs none: its strict mode is the build's contract, not its code."""
    build = effective_build(config)
    if config.rollout.engine is not Engine.SGLANG or build is None:
        return None
    return sglang_build_problem(build)


def sglang_version_problem() -> str | None:
    """None when the installed sglang is the pinned one; otherwise what is wrong."""
    return sglang_build_problem(BUILDS[DEFAULT_BUILD])


def sglang_command(config: TrainerConfig, port: int, host: str = "127.0.0.1", *, python: str = sys.executable,
                   api_key: str | None = None, admin_api_key: str | None = None, base_gpu_id: int | None = None,
                   mem_fraction_static: float | None = None, random_seed: int | None = None,
                   deterministic: bool | None = None, secrets_dir: str | None = None) -> EngineLaunch:
    """`python -m sglang.launch_server ...` for one engine of this job. `deterministic` (default: the
    config's `reproducible_rollouts`) adds `--enable-deterministic-inference` so `sampling_seed` counts.
    The keys go into `secret_files` under `secrets_dir` (default: the temp dir), named by `--config`."""
    mode = sync_mode(config)
    if mode == SyncMode.ENGINE_MERGE:
        raise UnsupportedEngineConfig(
            "lora.syncMode EngineMerge needs an engine that folds lora_A/lora_B into its base "
            f"(weight_update_mode lora_merge); sglang {SGLANG_VERSION}'s LLM server has none: "
            "use rollout.engine hf, or lora.syncMode Merge")
    rollout = config.rollout
    if rollout.gpus_per_engine < 1:
        raise UnsupportedEngineConfig("rollout.gpusPerEngine 0 means a CPU engine: use rollout.engine hf")
    argv = [python, "-m", "sglang.launch_server", "--model-path", config.model.path, "--host", host,
            "--port", str(port), "--tp-size", str(rollout.gpus_per_engine), "--dp-size", str(rollout.dp_size)]
    if lora_enabled(config):
        argv += ["--enable-lora", "--max-loras-per-batch", str(max_loras_per_batch(config)),
                 "--max-lora-rank", str(config.lora.rank),
                 "--lora-target-modules", *sglang_target_modules(config),
                 "--disable-radix-cache"]
    if config.deployment.mode == DeploymentMode.COLOCATE:
        fraction = COLOCATE_MEM_FRACTION if mem_fraction_static is None else mem_fraction_static
        argv += ["--mem-fraction-static", f"{fraction:g}", "--enable-memory-saver"]
    elif mem_fraction_static is not None:
        argv += ["--mem-fraction-static", f"{mem_fraction_static:g}"]
    if base_gpu_id is not None:
        argv += ["--base-gpu-id", str(base_gpu_id)]
    if random_seed is not None:
        argv += ["--random-seed", str(random_seed)]
    if reproducible_rollouts(config) if deterministic is None else deterministic:
        argv += ["--enable-deterministic-inference"]
    argv += config.rollout.sglang_args  # the user's own flags last: a later flag wins (rules refuse kora's)
    keys = {flag: key for flag, key in (("api-key", api_key), ("admin-api-key", admin_api_key)) if key}
    secret_files = {}
    if keys:  # a private YAML for SGLang's --config, not argv (see "Keys" above)
        path = str(Path(secrets_dir or tempfile.gettempdir()) / f"sglang-keys-{port}.yaml")
        secret_files[path] = "".join(f"{flag}: {json.dumps(key)}\n" for flag, key in keys.items())
        argv += ["--config", path]
    return EngineLaunch(argv, host, port, Engine.SGLANG.value, secret_files=secret_files)


def hf_engine_command(config: TrainerConfig, port: int, host: str = "127.0.0.1", *, python: str = sys.executable,
                      api_key: str | None = None, admin_api_key: str | None = None, dtype: str = "auto",
                      num_threads: int | None = None) -> EngineLaunch:
    """`python -m kora_engine.lm ...`: the reference engine for the same job (its keys in `env`)."""
    device = "cuda" if config.rollout.gpus_per_engine > 0 else "cpu"
    argv = [python, "-m", "kora_engine.lm", "--model-path", config.model.path, "--host", host,
            "--port", str(port), "--device", device, "--dtype", dtype,
            "--max-loras-per-batch", str(max_loras_per_batch(config)), "--max-lora-rank", str(config.lora.rank)]
    if num_threads:
        argv += ["--num-threads", str(num_threads)]
    if config.rollout.sglang_build is not None:  # that build's strict mode (kora_engine/lm/strict.py)
        argv += ["--sglang-build", config.rollout.sglang_build.value]
    env = {name: key for name, key in ((API_KEY_ENV, api_key), (ADMIN_API_KEY_ENV, admin_api_key)) if key}
    return EngineLaunch(argv, host, port, Engine.HF.value, env=env)  # the keys by environment, not argv


def engine_command(config: TrainerConfig, port: int, host: str = "127.0.0.1", **kwargs: object) -> EngineLaunch:
    """The command for `config.rollout.engine`; kwargs go to sglang_command / hf_engine_command."""
    if config.rollout.engine == Engine.SGLANG:
        return sglang_command(config, port, host, **kwargs)  # type: ignore[arg-type]
    return hf_engine_command(config, port, host, **kwargs)  # type: ignore[arg-type]
