"""Every object the operator creates for one job, in creation order (the RayJob mounts the others)."""

from __future__ import annotations

from typing import Any

from kora_operator.api.job import LoRATrainingJob, RuntimeKind
from kora_operator.builders.configmap import build_config_map
from kora_operator.builders.rayjob import build_ray_job
from kora_operator.builders.secret import build_secret


def build_children(job: LoRATrainingJob, token: str) -> list[dict[str, Any]]:
    children = [build_config_map(job), build_secret(job, token)]
    if job.spec.runtime.kind is RuntimeKind.KUBERAY:
        children.append(build_ray_job(job))
    return children
