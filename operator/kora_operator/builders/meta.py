"""Metadata every child object carries: labels, namespace and the controller ownerReference."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kora_operator.api.job import API_VERSION, LoRATrainingJob

MANAGED_BY = "kora"
JOB_LABEL = "kora.dev/job-name"
COMPONENT_LABEL = "kora.dev/component"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def labels(job: LoRATrainingJob, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/managed-by": MANAGED_BY,
        JOB_LABEL: str(job.metadata["name"]),
        COMPONENT_LABEL: component,
    }


def owner_reference(job: LoRATrainingJob) -> dict[str, Any] | None:
    """The controller reference the garbage collector follows; None before the API server gave a uid
    (e.g. `kora render` of a file)."""
    return job_owner_reference(job.metadata)


def job_owner_reference(job_metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """The same, from a job's metadata (the operator owns a LoRAAdapter to the job it names so)."""
    uid = job_metadata.get("uid")
    if not uid:
        return None
    return {
        "apiVersion": API_VERSION,
        "kind": "LoRATrainingJob",
        "name": str(job_metadata["name"]),
        "uid": str(uid),
        "controller": True,
        # the RayJob must not outlive its job while KubeRay still tears the Ray cluster down; nor, with a
        # foreground delete, an adapter its trainer has not retired yet
        "blockOwnerDeletion": True,
    }


def object_meta(job: LoRATrainingJob, name: str, component: str, **extra_labels: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.metadata.get("namespace", "default"),
        "labels": {**labels(job, component), **extra_labels},
    }
    owner = owner_reference(job)
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta
