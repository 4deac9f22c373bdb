"""Every object the operator creates for one job, in creation order (the RayJob mounts the others)."""

from __future__ import annotations

from typing import Any

from kora_operator.api.job import LoRATrainingJob, RuntimeKind
from kora_operator.builders.configmap import build_config_map
from kora_operator.builders.networkpolicy import Peers, build_network_policy
from kora_operator.builders.rayjob import build_ray_job
from kora_operator.builders.secret import build_engine_key_secret, build_secret


def build_children(job: LoRATrainingJob, token: str, engine_key: str,
                   peers: Peers | None = None) -> list[dict[str, Any]]:
    """`engine_key`: the engines' admin key, used only if the job's engine-key Secret does not exist yet;
    `peers` None: no NetworkPolicy (the operator's `--no-network-policy`). Runtime Ray gets neither the key's
    Secret (its trainer makes its own key) nor a NetworkPolicy (its pods are not the operator's)."""
    children = [build_config_map(job), build_secret(job, token)]
    if job.spec.runtime.kind is RuntimeKind.KUBERAY:
        children.append(build_engine_key_secret(job, engine_key))
        if peers is not None:
            children.append(build_network_policy(job, peers))
        children.append(build_ray_job(job))
    return children
