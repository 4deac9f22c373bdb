"""The real KubeRay operator (ray-operator v1.5.0, built by hack/testbin.sh) accepts the RayJob
our operator makes and creates a RayCluster from it; our job then shows phase Provisioning.

No kubelet or scheduler runs here, so the Ray pods stay Pending: the test stops at the RayCluster.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from localcluster import Proc, free_ports, http_get, proc_start_time, stop_procs, wait_for
from operatorkit import Operator, apply, get, install_crds, job_status
from specs import valid_job

LOGS = Path("/tmp/kora-logs")


@pytest.fixture
def ns(cluster):
    install_crds(cluster)
    name = f"kuberay-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def kuberay(cluster, ns):
    metrics, probe = free_ports(2)
    log = LOGS / f"ray-operator-{ns}.log"
    cmd = [
        str(cluster.bin_dir / "ray-operator"), f"--metrics-addr=127.0.0.1:{metrics}",
        f"--health-probe-bind-address=127.0.0.1:{probe}", "--enable-leader-election=false",
        f"--watch-namespace={ns}", "--log-stdout-encoder=console",
    ]
    LOGS.mkdir(exist_ok=True)
    with open(log, "wb") as fh:  # controller-runtime reads KUBECONFIG from cluster.env()
        popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                 env=cluster.env(), start_new_session=True)
    proc = Proc("ray-operator", popen.pid, proc_start_time(popen.pid), str(log), cmd, popen)
    try:
        wait_for(lambda: proc.alive() and http_get(f"http://127.0.0.1:{probe}/readyz")[0] == 200, timeout=60,
                 interval=0.3, what=f"ray-operator readiness (log {log})")
        yield proc
    finally:
        stop_procs([proc])


def test_kuberay_creates_a_raycluster_from_our_rayjob(cluster, ns, kuberay):
    op = Operator(cluster, [ns], LOGS / f"operator-{ns}.log").start()
    try:
        apply(cluster, valid_job("real"), ns)

        def raycluster():
            out = cluster.kubectl("get", "rayclusters.ray.io", "-n", ns, "-o", "json").stdout
            items = json.loads(out)["items"]
            return items[0] if items else None

        rc = wait_for(raycluster, timeout=60, interval=0.5, what="KubeRay to create a RayCluster")
        rayjob = get(cluster, "rayjob", "real-ray", ns)
        assert rc["metadata"]["ownerReferences"][0]["uid"] == rayjob["metadata"]["uid"]
        head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        assert any(p["containerPort"] == 8068 for p in head["ports"])
        assert rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"][
            "nvidia.com/gpu"] == "8"
        status = wait_for(lambda: (s := job_status(cluster, "real", ns)).get("phase") == "Provisioning" and s,
                          timeout=60, interval=0.3, what="our job to show Provisioning")
        assert status["rayClusterName"] == rc["metadata"]["name"]
        assert rayjob["status"]["jobDeploymentStatus"] in ("Initializing", "Running")
    finally:
        op.stop()
