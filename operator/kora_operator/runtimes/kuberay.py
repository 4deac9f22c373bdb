"""Runtime KubeRay: where the trainer's control-plane API is (the rest lives in handlers/reconcile.py
and phase.py, which map the RayJob's status)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from kora_operator.builders.rayjob import CONTROL_PORT


def control_url(status: Mapping[str, Any], namespace: str) -> str | None:
    """http://<head service>:8068 — the host KubeRay reports in the RayJob's dashboardURL
    (`<cluster>-head-svc.<ns>.svc.cluster.local:8265`), else the head service named after the Ray
    cluster; None before KubeRay has named the cluster. Reachable from inside the cluster (where
    the operator runs); the builder exposes the port on the head pod and its service."""
    dashboard = str(status.get("dashboardURL") or "")
    host = urlsplit(dashboard if "://" in dashboard else f"//{dashboard}").hostname if dashboard else None
    if not host and status.get("rayClusterName"):
        host = f"{status['rayClusterName']}-head-svc.{namespace}.svc"
    return f"http://{host}:{CONTROL_PORT}" if host else None
