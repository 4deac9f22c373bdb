"""The seeds' flag spellings (Relax / miles / slime recipes) mapped onto kora's config fields.

A recipe written for those systems ports over: `--lora-rank 32 --lora-adapter-mode ...` become
the same dotted fields a `key=value` override sets, and the same rules apply. The flags Relax
rejects together (`--lora-merge-mode` with `--lora-adapter-mode`) are rejected here too (SPEC rule 1).
miles' `--multi-lora-adapter NAME PATH` reads the adapter.yaml at PATH (its snake_case keys) into an entry of
multiLora.adapters, appended to the job file's; SPEC rule 9 and the start-adapter rules then name the flag, the
file and the file's key (rules.start_adapter_problems with the AdapterOrigin made here).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kora_trainer.config.load import ConfigError
from kora_trainer.config.rules import AdapterOrigin
from kora_trainer.config.sections import ADAPTER_NAME, AUTO, DiffusionTarget, NamedAdapterRun, TargetModule

MODE_FLAGS_EXCLUSIVE = (
    "--lora-merge-mode and --lora-adapter-mode are mutually exclusive: pass only one of them "
    "(in a kora config: set lora.syncMode to Merge or Adapter)"
)


def slots_or_auto(value: str) -> int | str:
    """--multi-lora-n-adapters N or auto (miles #3261: slots sized from memory)."""
    return value if value == AUTO else int(value)


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
    "--lr-decay-style": ("algorithm.lrDecayStyle", str),
    "--min-lr": ("algorithm.minLr", float),
    "--lr-warmup-iters": ("algorithm.lrWarmupSteps", int),
    "--lr-decay-iters": ("algorithm.lrDecaySteps", int),
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
    "--multi-lora-n-adapters": ("multiLora.maxAdapters", slots_or_auto),
    "--multi-lora-max-adapter-global-batch-size": ("multiLora.maxAdapterGlobalBatchSize", int),
    "--multi-lora-max-coalesce-wait-s": ("multiLora.maxCoalesceWaitSeconds", float),
    # the diffusion seed's (miles-diffusion): they set fields of the job's diffusion section
    "--lora-init-weights": ("diffusion.loraInit", str),
    "--update-weight-target-module": ("diffusion.engineModule", str),
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
                       help="sets lora.targetModules (Megatron names, space-separated), or diffusion.targetModules "
                            "(diffusers names: to_q to_k ...)")
    group.add_argument("--use-lora", action="store_true", help="the diffusion seed's switch for LoRA: kora trains "
                       "LoRA adapters only, so it changes nothing (accepted so the seed's command lines run)")
    for flag, (field, value) in _SWITCHES.items():
        group.add_argument(flag, action="store_true", dest=_dest(flag), help=f"sets {field}={value}")
    group.add_argument("--lora-merge-mode", action="store_true", help="sets lora.syncMode=Merge")
    group.add_argument("--lora-adapter-mode", action="store_true", help="sets lora.syncMode=Adapter")
    group.add_argument("--multi-lora-adapter", nargs=2, action="append", default=None, metavar=("NAME", "PATH"),
                       dest="multi_lora_adapter",
                       help="train adapter NAME from the start (repeatable; appended to multiLora.adapters): PATH is "
                            f"its adapter.yaml, keys {', '.join(ADAPTER_YAML_KEYS)} and save; relative data and save "
                            "paths are taken from PATH's directory. kora writes the adapter under "
                            "<checkpoint.path>/adapters/NAME/ (--save sets checkpoint.path): a save elsewhere is "
                            "refused")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def seed_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted field -> value for every seed flag given on the command line (multiLora.adapters: a FlagAdapters,
    appended to the job's by as_overrides)."""
    out: dict[str, Any] = {}
    for flag, (field, _) in _VALUED.items():
        value = getattr(args, _dest(flag), None)
        if value is not None:
            out[field] = value
    if args.lora_target_modules:
        out[_target_field(list(args.lora_target_modules))] = list(args.lora_target_modules)
    for flag, (field, value) in _SWITCHES.items():
        if getattr(args, _dest(flag), False):
            out[field] = value
    if args.lora_merge_mode and args.lora_adapter_mode:
        raise ConfigError([MODE_FLAGS_EXCLUSIVE])
    if args.lora_merge_mode:
        out["lora.syncMode"] = "Merge"
    if args.lora_adapter_mode:
        out["lora.syncMode"] = "Adapter"
    if args.multi_lora_adapter:
        out[ADAPTERS] = flag_adapters(args.multi_lora_adapter)
    if out.get("lora.rank") == 0:
        raise ConfigError(["--lora-rank 0 disables LoRA, and kora trains LoRA adapters only: "
                           "pass --lora-rank 1 or more"])
    return out


def _target_field(names: list[str]) -> str:
    """--lora-target-modules names Megatron modules (an LLM job's lora.targetModules) or diffusers ones (a diffusion
    job's diffusion.targetModules); the two vocabularies do not overlap, so the names say which."""
    megatron = {m.value for m in TargetModule}
    diffusers = {m.value for m in DiffusionTarget}
    if set(names) <= megatron:
        return "lora.targetModules"
    if set(names) <= diffusers:
        return "diffusion.targetModules"
    raise ConfigError([f"--lora-target-modules {' '.join(names)}: give Megatron names ({', '.join(sorted(megatron))}) "
                       f"for a language model, or diffusers names ({', '.join(sorted(diffusers))}) for a diffusion "
                       "job, not a mix or others"])


def parse_seed_flags(argv: Sequence[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_seed_flags(parser)
    try:
        args = parser.parse_args(list(argv))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ConfigError([f"cannot parse flags: {e}"]) from e
    return seed_flag_values(args)


def as_overrides(values: dict[str, Any]) -> list[str]:
    """The same values as `key=value` override strings (values in YAML flow style, one line each); the
    --multi-lora-adapter adapters as `multiLora.adapters+=[...]`, after the job's own."""

    def flow(v: Any) -> str:
        return yaml.safe_dump(v, default_flow_style=True, width=2**31).strip().removesuffix("...").strip()

    return [f"{k}+={flow(v.runs)}" if isinstance(v, FlagAdapters) else f"{k}={flow(v)}" for k, v in values.items()]


def origins(values: dict[str, Any]) -> tuple[AdapterOrigin, ...]:
    """Where the --multi-lora-adapter adapters were written (load_config's `origins`), in their order."""
    adapters = values.get(ADAPTERS)
    return adapters.origins if isinstance(adapters, FlagAdapters) else ()


# ---- --multi-lora-adapter NAME PATH: the seed's adapter.yaml --------------------------------------------------------

ADAPTERS = "multiLora.adapters"
# adapter.yaml key -> the NamedAdapterRun field it sets (dotted, camelCase); lr, seed and the schedule keys (the
# Megatron flags' spellings, as --lr-decay-style etc.) are kora's (default: the job's). `save`, the seed's
# per-adapter save directory, sets nothing: it must be where kora writes the adapter.
ADAPTER_YAML_KEYS: dict[str, str] = {
    "rank": "rank", "alpha": "alpha", "rollout_batch_size": "rolloutBatchSize",
    "n_samples_per_prompt": "nSamplesPerPrompt", "data": "data.path", "input_key": "data.inputKey",
    "label_key": "data.labelKey", "rm_type": "data.rewardType", "custom_rm_path": "data.customRewardPath",
    "num_step": "numSteps", "num_epoch": "numEpochs", "lr": "lr", "seed": "seed",
    "lr_decay_style": "lrDecayStyle", "min_lr": "minLr", "lr_warmup_iters": "lrWarmupSteps",
    "lr_decay_iters": "lrDecaySteps",
}
_PATH_KEYS = ("data", "save")  # relative paths: from the adapter.yaml's directory
# NamedAdapterRun field -> the file's key: how messages about a flag's adapter spell its keys
_FILE_KEYS = {f: k for k, f in ADAPTER_YAML_KEYS.items() if f != k} | {"data": "data"}


@dataclass(frozen=True)
class FlagAdapters:
    """--multi-lora-adapter's adapters: NamedAdapterRun fields (camelCase) appended to multiLora.adapters, and
    where each was written (the flag, its file, the file's spelling of the keys, its save)."""

    runs: list[dict[str, Any]]
    origins: tuple[AdapterOrigin, ...]


def flag_adapters(pairs: Sequence[Sequence[str]]) -> FlagAdapters:
    """Every `--multi-lora-adapter NAME PATH`, read and checked field by field; one ConfigError for all of them."""
    runs: list[dict[str, Any]] = []
    found: list[AdapterOrigin] = []
    problems: list[str] = []
    for name, file in pairs:
        try:
            run, origin = read_adapter_yaml(name, file)
        except ConfigError as e:
            problems += e.problems
            continue
        runs.append(run)
        found.append(origin)
    if problems:
        raise ConfigError(problems)
    return FlagAdapters(runs, tuple(found))


def read_adapter_yaml(name: str, file: str) -> tuple[dict[str, Any], AdapterOrigin]:
    """One adapter.yaml as NamedAdapterRun fields; ConfigError lines name the flag, the file, the key and the fix."""
    label = f"--multi-lora-adapter {name} {file}"
    try:
        doc = yaml.safe_load(Path(file).read_text())
    except OSError as e:
        raise ConfigError([f"{label}: cannot read {file} ({e.strerror}): PATH must be the adapter's adapter.yaml "
                           "(rank, data, ...)"]) from e
    except yaml.YAMLError as e:
        raise ConfigError([f"{label}: {file} is not valid YAML: {e}"]) from e
    if not isinstance(doc, dict):
        held = "nothing" if doc is None else f"a {type(doc).__name__}"
        raise ConfigError([f"{label}: {file} holds {held}; it must be a mapping of keys (rank: 16, data: "
                           "train.parquet, ...)"])
    problems: list[str] = []
    if not re.fullmatch(ADAPTER_NAME, name):
        problems.append(f"{label}: NAME {name} must be a DNS label (lower-case letters, digits, '-' and '.', at "
                        "most 63, starting and ending with a letter or digit): it is the adapter's lora_path, its "
                        "request-id prefix and its directory adapters/NAME/")
    unknown = sorted(str(k) for k in doc if k not in ADAPTER_YAML_KEYS and k != "save")
    if unknown:
        problems.append(f"{label}: unknown key{'s' * (len(unknown) > 1)} {', '.join(unknown)} in {file}: remove or "
                        f"respell {'them' if len(unknown) > 1 else 'it'} (the keys: {', '.join(ADAPTER_YAML_KEYS)}, "
                        "save)")
    save = doc.get("save")
    if save is not None and not isinstance(save, str):
        problems.append(f"{label}: save in {file} must be a directory path, not {save!r}")
    if problems:
        raise ConfigError(problems)
    here = os.path.dirname(os.path.abspath(file))
    doc = {k: os.path.normpath(os.path.join(here, v)) if k in _PATH_KEYS and isinstance(v, str) else v
           for k, v in doc.items()}  # join keeps an absolute path as it is
    run: dict[str, Any] = {"name": name}
    for key, value in doc.items():
        if key != "save":
            *sections, last = ADAPTER_YAML_KEYS[key].split(".")
            node = run
            for section in sections:
                node = node.setdefault(section, {})
            node[last] = value
    try:
        NamedAdapterRun.model_validate(run)
    except ValidationError as e:
        raise ConfigError([f"{label}: {line}" for line in _in_file_terms(e)]) from e
    return run, AdapterOrigin(label, _FILE_KEYS, doc.get("save"))


def _respell(text: str) -> str:
    """NamedAdapterRun's field names in a message -> the adapter.yaml's keys."""
    for field, key in sorted(_FILE_KEYS.items(), key=lambda fk: -len(fk[0])):
        text = re.sub(rf"(?<![\w.]){re.escape(field)}(?!\w)", key, text)
    return text


def _in_file_terms(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = "required key is missing: set it" if e["type"] == "missing" else e["msg"].removeprefix("Value error, ")
        lines.append(f"{_FILE_KEYS.get(loc, loc)}: {_respell(msg)}" if loc else _respell(msg))
    return lines
