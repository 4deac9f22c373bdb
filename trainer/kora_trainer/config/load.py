"""Load a TrainerConfig: YAML file (a bare spec or a whole LoRATrainingJob) + `key=value` overrides."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kora_trainer.config.rules import AdapterOrigin, Problem, model_problems, spec_problems, start_adapter_problems
from kora_trainer.config.trainer import TrainerConfig


class ConfigError(ValueError):
    """A config that cannot run; `problems` holds one line per broken field or rule."""

    def __init__(self, problems: list[str]):
        super().__init__("invalid kora config:\n  " + "\n  ".join(problems))
        self.problems = problems


def format_validation_error(err: ValidationError, prefix: str = "") -> list[str]:
    """pydantic errors as 'spec.lora.rank: Input should be ...' lines (camelCase paths)."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = ("unknown field: remove it or fix its spelling (fields are camelCase, e.g. "
                   "syncMode; `kubectl explain loratrainingjob.spec` lists them)")
        elif e["type"] == "missing":
            msg = "required field is missing: set it"
        lines.append(f"{prefix}{loc}: {msg}" if loc else f"{prefix.rstrip('.')}: {msg}")
    return lines


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """`lora.syncMode=Adapter algorithm.numSteps=20` -> nested keys; values parsed as YAML. `key+=[...]` appends
    the list's items to the list at key (multiLora.adapters+=[{name: a, ...}])."""
    out: dict[str, Any] = json.loads(json.dumps(data))  # deep copy; inputs are plain YAML data
    for item in overrides:
        key, sep, raw = item.partition("=")
        key, append = key.removesuffix("+"), key.endswith("+")
        if not sep or not key:
            raise ConfigError([f"override {item!r}: write it as dotted.key=value, e.g. lora.syncMode=Adapter"])
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError([f"override {item!r}: {part} is not a section"])
        value = yaml.safe_load(raw)
        if append:
            have = node.get(parts[-1]) or []
            if not isinstance(have, list) or not isinstance(value, list):
                raise ConfigError([f"override {item!r}: += appends a list to a list: write {key}+=[item, ...], or "
                                   f"{key}=value to replace"])
            value = [*have, *value]
        node[parts[-1]] = value
    return out


# What a LoRATrainingJob's spec holds beyond the trainer's sections: the pods', the runtime's and the lifecycle's
# business, read by the operator (kora_operator.api.job.LoRATrainingJobSpec adds exactly these; a test keeps the
# two in step). A whole manifest given to the trainer leaves them out; a bare trainer spec must not carry them.
CLUSTER_FIELDS = frozenset({"image", "resources", "runtime", "suspend", "backoffLimit", "ttlSecondsAfterFinished",
                            "queueName"})
CLUSTER_MODEL_FIELDS = frozenset({"volume"})


def spec_of(document: Mapping[str, Any]) -> dict[str, Any]:
    """Accept either a bare trainer spec or a whole LoRATrainingJob manifest (its cluster fields left out)."""
    if document.get("kind") == "LoRATrainingJob":
        spec = {k: v for k, v in dict(document.get("spec") or {}).items() if k not in CLUSTER_FIELDS}
        if isinstance(spec.get("model"), Mapping):
            spec["model"] = {k: v for k, v in spec["model"].items() if k not in CLUSTER_MODEL_FIELDS}
        return spec
    return dict(document)


def read_hf_config(model_path: str) -> dict[str, Any] | None:
    """The model's config.json when it is readable from here (else None: those rules wait)."""
    path = Path(model_path) / "config.json"
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def check(cfg: TrainerConfig, hf_config: Mapping[str, Any] | None = None,
          origins: Sequence[AdapterOrigin] = ()) -> list[Problem]:
    """Every rule: spec-only ones, the adapters given at start (`origins`: see start_adapter_problems), and
    config.json ones when the model is readable."""
    if hf_config is None:
        hf_config = read_hf_config(cfg.model.path)
    return spec_problems(cfg) + start_adapter_problems(cfg, origins) + model_problems(cfg, hf_config)


def load_config(path: str | Path | None, overrides: Iterable[str] = (), base: Mapping[str, Any] | None = None,
                origins: Sequence[AdapterOrigin] = ()) -> tuple[TrainerConfig, list[Problem]]:
    """Parse, apply overrides, validate. Raises ConfigError on any error; returns warnings. `origins` say where
    the last multiLora.adapters entries were written (the trainer's --multi-lora-adapter flags)."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        try:
            document = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError([f"--config {path}: {e.strerror}"]) from e
        except yaml.YAMLError as e:
            raise ConfigError([f"--config {path}: not valid YAML: {e}"]) from e
        data.update(spec_of(document))
    data = apply_overrides(data, overrides)
    try:
        cfg = TrainerConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from e
    problems = check(cfg, origins=origins)
    errors = [p.message for p in problems if p.severity == "error"]
    if errors:
        raise ConfigError(errors)
    return cfg, [p for p in problems if p.severity == "warning"]
