"""The trainer-config ConfigMap: the rendered job.yaml the trainer reads at /etc/kora/job.yaml."""

from __future__ import annotations

from typing import Any

import yaml

from kora_operator.api.job import LoRATrainingJob
from kora_operator.builders.names import config_map_name

CONFIG_KEY = "job.yaml"
CONFIG_MOUNT_DIR = "/etc/kora"


def labels(job: LoRATrainingJob, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/managed-by": "kora",
        "kora.dev/job-name": str(job.metadata["name"]),
        "kora.dev/component": component,
    }


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings as literal blocks, so rendered ConfigMaps read like the YAML inside."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


def dump_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_BlockDumper, sort_keys=False)


def trainer_config_yaml(job: LoRATrainingJob) -> str:
    """Only the trainer's sections, every default written out, so the trainer reads a frozen config."""
    cfg = job.spec.trainer_config()
    return yaml.safe_dump(cfg.model_dump(by_alias=True, mode="json", exclude_none=True), sort_keys=False)


def build_config_map(job: LoRATrainingJob) -> dict[str, Any]:
    name = str(job.metadata["name"])
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": config_map_name(name),
            "namespace": job.metadata.get("namespace", "default"),
            "labels": labels(job, "trainer-config"),
        },
        "data": {CONFIG_KEY: trainer_config_yaml(job)},
    }
