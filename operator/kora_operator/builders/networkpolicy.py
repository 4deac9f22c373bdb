"""The per-job NetworkPolicy (SPEC "Security"): who may open a connection to the pods of a job's RayJob.

- the job's own pods (its Ray head, workers and KubeRay's submitter pod, all labelled with the job's name):
  every port, since Ray (GCS, raylets, object transfer), the engines' HTTP servers and NCCL / gloo use ports
  picked at run time;
- the kora operator's pods (their namespace and labels, `Peers`): the trainer's control-plane port only
  (the progress poll and `/adapter_runs`, with the job's bearer token);
- KubeRay's operator: the Ray dashboard's port only (its RayJob controller reads the Ray job's state there).

Nothing else: an engine's weight and LoRA routes, Ray's ports and the control plane are closed to every other
pod in the cluster. Ingress only: the job's pods still reach the API server, registries and storage. The
policy binds only where the cluster's network plugin enforces NetworkPolicies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kora_operator.api.job import LoRATrainingJob
from kora_operator.builders.meta import JOB_LABEL, MANAGED_BY, object_meta
from kora_operator.builders.names import network_policy_name
from kora_trainer.config.control import CONTROL_PORT

DASHBOARD_PORT = 8265  # the Ray head's dashboard and Jobs API (KubeRay's default dashboard-port)
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace (>= 1.22)
KUBERAY_OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}  # KubeRay's Helm chart's pod labels


@dataclass(frozen=True)
class Peers:
    """The pods outside a job that may reach it, each as (namespace, pod labels).

    `operator_namespace` None (the operator does not run in a pod, or does not know where): no pod but the
    job's own reaches the control-plane port. `kuberay_namespace` None: KubeRay's operator in any namespace.
    """

    operator_namespace: str | None = None
    operator_labels: Mapping[str, str] = field(default_factory=dict)
    kuberay_namespace: str | None = None
    kuberay_labels: Mapping[str, str] = field(default_factory=lambda: dict(KUBERAY_OPERATOR_LABELS))


def job_pod_selector(job: LoRATrainingJob) -> dict[str, Any]:
    """The pods of the job: every pod template the RayJob builder writes carries these labels."""
    return {"matchLabels": {"app.kubernetes.io/managed-by": MANAGED_BY, JOB_LABEL: str(job.metadata["name"])}}


def _peer(namespace: str | None, pod_labels: Mapping[str, str]) -> dict[str, Any]:
    ns = {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}} if namespace else {}  # {}: every namespace
    return {"namespaceSelector": ns, "podSelector": {"matchLabels": dict(pod_labels)}}


def _tcp(port: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port}]


def build_network_policy(job: LoRATrainingJob, peers: Peers) -> dict[str, Any]:
    own = job_pod_selector(job)
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": own}]}]  # no `ports`: all of them
    if peers.operator_namespace and peers.operator_labels:
        ingress.append({"from": [_peer(peers.operator_namespace, peers.operator_labels)],
                        "ports": _tcp(CONTROL_PORT)})
    if peers.kuberay_labels:
        ingress.append({"from": [_peer(peers.kuberay_namespace, peers.kuberay_labels)],
                        "ports": _tcp(DASHBOARD_PORT)})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(job, network_policy_name(str(job.metadata["name"])), "network-policy"),
        "spec": {"podSelector": own, "policyTypes": ["Ingress"], "ingress": ingress},
    }
