"""The seeds' flag spellings (Relax / miles / slime recipes) mapped onto kora's config fields.

A recipe written for those systems ports over: `--lora-rank 32 --lora-adapter-mode ...` become
the same dotted fields a `key=value` override sets, and the same rules apply. The flags Relax
rejects together (`--lora-merge-mode` with `--lora-adapter-mode`) are rejected here too (SPEC rule 1).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from kora_trainer.config.load import ConfigError

MODE_FLAGS_EXCLUSIVE = (
    "--lora-merge-mode and --lora-adapter-mode are mutually exclusive: pass only one of them "
    "(in a kora config: set lora.syncMode to Merge or Adapter)"
)

# flag -> (dotted field, type); store_true flags map to a fixed value below
_VALUED: dict[str, tuple[str, Any]] = {
    "--lora-rank": ("lora.rank", int),
    "--lora-alpha": ("lora.alpha", float),
    "--lora-dropout": ("lora.dropout", float),
    "--lora-scope": ("lora.scope", str),
    "--update-weight-buffer-size": ("sync.bufferSize", str),
    "--rollout-num-gpus-per-engine": ("rollout.gpusPerEngine", int),
    "--sglang-dp-size": ("rollout.dpSize", int),
    "--tensor-model-parallel-size": ("parallelism.tensor", int),
    "--pipeline-model-parallel-size": ("parallelism.pipeline", int),
    "--context-parallel-size": ("parallelism.context", int),
    "--expert-model-parallel-size": ("parallelism.expert", int),
    "--expert-tensor-parallel-size": ("parallelism.expertTensor", int),
    "--hf-checkpoint": ("model.path", str),
    "--prompt-data": ("data.path", str),
    "--input-key": ("data.inputKey", str),
    "--label-key": ("data.labelKey", str),
    "--rm-type": ("data.rewardType", str),
    "--custom-rm-path": ("data.customRewardPath", str),
    "--lr": ("algorithm.lr", float),
    "--num-rollout": ("algorithm.numSteps", int),
    "--num-epoch": ("algorithm.numEpochs", int),
    "--rollout-batch-size": ("algorithm.rolloutBatchSize", int),
    "--n-samples-per-prompt": ("algorithm.nSamplesPerPrompt", int),
    "--global-batch-size": ("algorithm.globalBatchSize", int),
    "--rollout-max-response-len": ("algorithm.maxNewTokens", int),
    "--rollout-temperature": ("algorithm.temperature", float),
    "--eps-clip": ("algorithm.clipEps", float),
    "--kl-loss-coef": ("algorithm.klCoef", float),
    "--seed": ("algorithm.seed", int),
    "--save": ("checkpoint.path", str),
    "--save-interval": ("checkpoint.interval", int),
    "--multi-lora-n-adapters": ("multiLora.maxAdapters", int),
}
_SWITCHES: dict[str, tuple[str, Any]] = {
    "--save-lora-only": ("checkpoint.loraOnly", True),
    "--save-hf": ("checkpoint.exportHF", True),
    "--async-save": ("checkpoint.asyncSave", True),
    "--fp16": ("checkpoint.dtype", "fp16"),
    "--fp8": ("checkpoint.dtype", "fp8"),
    "--colocate": ("deployment.mode", "Colocate"),
    "--lora-ipc-weight-sync": ("lora.syncMode", "EngineMerge"),
}


def add_seed_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("seed-compatible flags (Relax / miles spellings)")
    for flag, (field, kind) in _VALUED.items():
        group.add_argument(flag, type=kind, default=None, dest=_dest(flag), help=f"sets {field}")
    group.add_argument("--lora-target-modules", nargs="+", default=None, dest="lora_target_modules",
                       help="sets lora.targetModules (Megatron names, space-separated)")
    for flag, (field, value) in _SWITCHES.items():
        group.add_argument(flag, action="store_true", dest=_dest(flag), help=f"sets {field}={value}")
    group.add_argument("--lora-merge-mode", action="store_true", help="sets lora.syncMode=Merge")
    group.add_argument("--lora-adapter-mode", action="store_true", help="sets lora.syncMode=Adapter")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def seed_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted field -> value for every seed flag given on the command line."""
    out: dict[str, Any] = {}
    for flag, (field, _) in _VALUED.items():
        value = getattr(args, _dest(flag), None)
        if value is not None:
            out[field] = value
    if args.lora_target_modules:
        out["lora.targetModules"] = list(args.lora_target_modules)
    for flag, (field, value) in _SWITCHES.items():
        if getattr(args, _dest(flag), False):
            out[field] = value
    if args.lora_merge_mode and args.lora_adapter_mode:
        raise ConfigError([MODE_FLAGS_EXCLUSIVE])
    if args.lora_merge_mode:
        out["lora.syncMode"] = "Merge"
    if args.lora_adapter_mode:
        out["lora.syncMode"] = "Adapter"
    if out.get("lora.rank") == 0:
        raise ConfigError(["--lora-rank 0 disables LoRA, and kora trains LoRA adapters only: "
                           "pass --lora-rank 1 or more"])
    return out


def parse_seed_flags(argv: Sequence[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_seed_flags(parser)
    try:
        args = parser.parse_args(list(argv))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ConfigError([f"cannot parse flags: {e}"]) from e
    return seed_flag_values(args)


def as_overrides(values: dict[str, Any]) -> list[str]:
    """The same values as `key=value` override strings (values in YAML flow style)."""
    import yaml

    return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
            for k, v in values.items()]
