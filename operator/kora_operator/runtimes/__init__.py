"""Where the trainer runs, behind one protocol (base.Runtime): KubeRay (a RayJob per LoRATrainingJob: kuberay.py)
or Ray (a submission to an existing Ray cluster through its Jobs API: ray.py). A reconcile chooses one, once
(`runtime_of`), and asks it; nothing else branches on the kind."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kora_operator.api.job import RuntimeKind
from kora_operator.runtimes.base import Runtime
from kora_operator.runtimes.kuberay import KubeRay
from kora_operator.runtimes.ray import Ray

KUBERAY = KubeRay()
RAY = Ray()

__all__ = ["KUBERAY", "RAY", "KubeRay", "Ray", "Runtime", "runtime_of"]


def runtime_of(spec: Mapping[str, Any]) -> Runtime:
    """The runtime a job's spec (as the API holds it) names: spec.runtime.kind, KubeRay when unset."""
    kind = (spec.get("runtime") or {}).get("kind")
    return RAY if kind == RuntimeKind.RAY else KUBERAY
