"""The trainer-config ConfigMap: the rendered job.yaml the trainer reads at /etc/kora/job.yaml."""

from __future__ import annotations

from typing import Any

import yaml

from kora_operator.api.job import LoRATrainingJob
from kora_operator.builders.meta import labels, object_meta
from kora_operator.builders.names import config_map_name
from kora_trainer.config.ray_env import BOOTSTRAP_FILE, BOOTSTRAP_TEXT

CONFIG_KEY = "job.yaml"
CONFIG_MOUNT_DIR = "/etc/kora"


__all__ = ["CONFIG_KEY", "CONFIG_MOUNT_DIR", "build_config_map", "dump_yaml", "labels", "trainer_config_yaml"]


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings as literal blocks, so rendered ConfigMaps read like the YAML inside."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


# libyaml's emitter where PyYAML was built with it (a third of the pure-Python one's CPU per job in a burst); what
# it writes loads back the same (it may fold a long quoted string at another place)
_SafeDumper: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def dump_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_BlockDumper, sort_keys=False)


def trainer_config_yaml(job: LoRATrainingJob) -> str:
    """Only the trainer's sections, every default written out, so the trainer reads a frozen config."""
    cfg = job.spec.trainer_config()
    return yaml.dump(cfg.model_dump(by_alias=True, mode="json", exclude_none=True), Dumper=_SafeDumper, sort_keys=False)


def build_config_map(job: LoRATrainingJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(job, config_map_name(str(job.metadata["name"])), "trainer-config"),
        # and Ray's bootstrap config, which the pods mount into their writable HOME (builders/rayjob.py)
        "data": {CONFIG_KEY: trainer_config_yaml(job), BOOTSTRAP_FILE: BOOTSTRAP_TEXT},
    }
