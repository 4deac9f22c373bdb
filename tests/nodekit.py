"""A control plane with a real node (hack/localnode.py) for tests, and bounded waits on its pods.

    with node_cluster(tmp_dir) as cluster:       # skips (with the reason) where a node cannot run
        cluster.kubectl("apply", "-f", "-", input=pod_yaml)
        wait_pod_phase(cluster, ns, "client", "Succeeded")

Other helpers (the images branch) import their own archives with `localnode.import_image(cluster.state_dir,
archive)`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import localnode
from localcluster import LocalCluster, wait_for

SKIP_ENV = "KORA_SKIP_CLUSTER"


@contextlib.contextmanager
def node_cluster(state_dir: Path, nodes: int = 1) -> Iterator[LocalCluster]:
    """etcd + kube-apiserver + kube-controller-manager + `nodes` real nodes, stopped (everything removed) after.

    Skips where the machine cannot run a node (not root, containerd/runc/CNI plugins/iptables missing),
    or when KORA_SKIP_CLUSTER=1; any other failure to start is an error."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: not starting the local cluster")
    if why := localnode.missing_prerequisites():
        pytest.skip("a real node cannot run here: " + "; ".join(why))
    c = LocalCluster.start(state_dir, node=True, nodes=nodes)
    try:
        yield c
    finally:
        c.stop()


def probe_server(name: str, node: str | None = None) -> str:
    """A pod serving HTTP on 8080 from the probe image (labels app=<name>), pinned to `node` if given."""
    pin = f"\n  nodeName: {node}" if node else ""
    return f"""apiVersion: v1
kind: Pod
metadata: {{name: {name}, labels: {{app: {name}}}}}
spec:{pin}
  containers:
  - name: web
    image: {localnode.PROBE_IMAGE}
    imagePullPolicy: Never
    args: [serve, ":8080"]
    ports: [{{containerPort: 8080}}]
    readinessProbe: {{httpGet: {{path: /, port: 8080}}, periodSeconds: 1}}
    resources: {{requests: {{cpu: 10m, memory: 16Mi}}}}
"""


def probe_client(name: str, url: str, node: str | None = None, seconds: int = 90) -> str:
    """A run-once pod that GETs `url` (retrying up to `seconds`) and exits 0 on a 200."""
    pin = f"\n  nodeName: {node}" if node else ""
    return f"""apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:{pin}
  restartPolicy: Never
  containers:
  - name: get
    image: {localnode.PROBE_IMAGE}
    imagePullPolicy: Never
    args: [get, "{url}", "{seconds}"]
"""


def pod(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    got: dict[str, Any] = json.loads(cluster.kubectl("-n", ns, "get", "pod", name, "-o", "json").stdout)
    return got


def wait_pod_phase(cluster: LocalCluster, ns: str, name: str, phase: str, timeout: float = 120) -> dict[str, Any]:
    """Wait (bounded) until the pod reaches `phase`; fail at once if it reaches a final phase that is not it."""

    def probe() -> dict[str, Any] | None:
        p = pod(cluster, ns, name)
        now = p.get("status", {}).get("phase")
        if now != phase and now in ("Succeeded", "Failed"):
            logs = cluster.kubectl("-n", ns, "logs", name, check=False)
            raise AssertionError(f"pod {ns}/{name} ended {now}, not {phase}: {logs.stdout}{logs.stderr}")
        return p if now == phase else None

    try:
        return wait_for(probe, timeout=timeout, interval=0.5, what=f"pod {ns}/{name} to be {phase}")
    except TimeoutError as exc:
        desc = cluster.kubectl("-n", ns, "describe", "pod", name, check=False).stdout
        raise AssertionError(f"{exc}\n{desc}") from exc


def wait_pod_ready(cluster: LocalCluster, ns: str, name: str, timeout: float = 120) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        p = pod(cluster, ns, name)
        conds = {c["type"]: c["status"] for c in p.get("status", {}).get("conditions", [])}
        return p if conds.get("Ready") == "True" else None

    try:
        return wait_for(probe, timeout=timeout, interval=0.5, what=f"pod {ns}/{name} to be Ready")
    except TimeoutError as exc:
        desc = cluster.kubectl("-n", ns, "describe", "pod", name, check=False).stdout
        raise AssertionError(f"{exc}\n{desc}") from exc
