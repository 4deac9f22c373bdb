"""The local control plane is the real thing: pinned version, RBAC on, service-account tokens
work, and kube-controller-manager really runs (garbage collection). `down` leaves nothing running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localcluster import HACK_DIR, ClusterError, LocalCluster, pid_alive, read_versions, wait_for


def test_server_version_is_pinned(kubectl):
    out = json.loads(kubectl("version", "-o", "json").stdout)
    pinned = read_versions()["KUBERNETES_VERSION"]
    assert out["serverVersion"]["gitVersion"] == pinned
    assert out["clientVersion"]["gitVersion"] == pinned


def test_service_account_is_usable_and_rbac_is_enforced(kubectl, namespace):
    ns, sa = namespace, "bot"
    who = f"system:serviceaccount:{ns}:{sa}"
    kubectl("-n", ns, "create", "serviceaccount", sa)
    kubectl("-n", ns, "create", "role", "pod-getter", "--verb=get", "--resource=pods")
    kubectl(
        "-n", ns, "create", "rolebinding", "bot-gets-pods", "--role=pod-getter", f"--serviceaccount={ns}:{sa}"
    )  # fmt: skip

    def can(*what: str) -> subprocess.CompletedProcess[str]:
        return kubectl("-n", ns, "auth", "can-i", *what, f"--as={who}", check=False)

    # the RBAC authorizer sees the new binding through its informer: allow it a moment
    wait_for(lambda: can("get", "pods").stdout.strip() == "yes", timeout=30, what=f"{who} may get pods")
    denied = can("delete", "nodes")
    assert (denied.returncode, denied.stdout.strip()) == (1, "no"), denied
    assert can("list", "pods").stdout.strip() == "no"

    # a real token, signed with the generated service-account key, authenticates as the SA
    token = kubectl("-n", ns, "create", "token", sa, "--duration=10m").stdout.strip()
    whoami = json.loads(kubectl("auth", "whoami", "-o", "json", f"--token={token}").stdout)
    assert whoami["status"]["userInfo"]["username"] == who
    # get is allowed (so a missing pod is NotFound), deleting nodes is forbidden
    got = kubectl("-n", ns, "get", "pod", "no-such-pod", f"--token={token}", check=False)
    assert got.returncode != 0 and "NotFound" in got.stderr, got.stderr
    nodes = kubectl("delete", "node", "any", f"--token={token}", check=False)
    assert nodes.returncode != 0 and "Forbidden" in nodes.stderr, nodes.stderr


def test_garbage_collector_deletes_dependents(kubectl, namespace):
    ns = namespace
    kubectl("-n", ns, "create", "configmap", "owner", "--from-literal=role=owner")
    kubectl("-n", ns, "create", "configmap", "bystander", "--from-literal=role=bystander")
    uid = kubectl("-n", ns, "get", "configmap", "owner", "-o", "jsonpath={.metadata.uid}").stdout.strip()
    assert uid
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent",
            "namespace": ns,
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}],
        },
        "data": {"role": "dependent"},
    }
    kubectl("create", "-f", "-", input=json.dumps(dependent))

    kubectl("-n", ns, "delete", "configmap", "owner", "--cascade=background")

    def dependent_gone() -> bool:
        out = kubectl("-n", ns, "get", "configmap", "dependent", "--ignore-not-found", "-o", "name").stdout
        return out.strip() == ""

    wait_for(dependent_gone, timeout=60, interval=0.5, what="the garbage collector to delete the dependent")
    bystander = kubectl("-n", ns, "get", "configmap", "bystander", "-o", "name").stdout.strip()
    assert bystander == "configmap/bystander"


def test_stop_leaves_no_recorded_process_alive(cluster, tmp_path):
    other = LocalCluster.start(tmp_path / "state", bin_dir=cluster.bin_dir)
    procs = dict(other.procs)
    assert set(procs) == {"etcd", "kube-apiserver", "kube-controller-manager"}
    assert other.healthy()
    assert other.pids != cluster.pids
    other.stop()
    alive = {n: p.pid for n, p in procs.items() if pid_alive(p.pid, p.start_time)}
    assert alive == {}
    assert not other.run_dir.exists()
    assert not (tmp_path / "state" / "cluster.json").exists()
    other.stop()  # idempotent
    assert cluster.healthy(), "stopping another cluster must not touch this one"


def test_cli_up_is_idempotent_and_down_stops_everything(cluster, tmp_path):
    state = tmp_path / "state"
    env = {**os.environ, "KORA_TESTBIN": str(cluster.bin_dir)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(HACK_DIR / "localcluster.py"), *args, "--dir", str(state)],
            capture_output=True, text=True, env=env, timeout=180, check=False,
        )  # fmt: skip

    up = cli("up")
    assert up.returncode == 0, up.stderr
    assert up.stdout.strip() == f"export KUBECONFIG={state / 'kubeconfig'}"
    recorded = json.loads((state / "cluster.json").read_text())["processes"]
    try:
        again = cli("up")
        assert again.returncode == 0 and "already up" in again.stderr, again.stderr
        assert json.loads((state / "cluster.json").read_text())["processes"] == recorded
        status = cli("status")
        assert status.returncode == 0 and json.loads(status.stdout)["healthy"] is True, status
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    still = {n: p["pid"] for n, p in recorded.items() if pid_alive(p["pid"], p["start_time"])}
    assert still == {}
    assert not any(Path(state, "cluster").glob("run-*"))
    assert cli("down").returncode == 0
    assert cli("status").returncode == 1


def test_a_component_that_dies_fails_start_with_its_log_and_leaves_nothing(cluster, tmp_path):
    bins = tmp_path / "bin"
    bins.mkdir()
    for name in ("etcd", "kube-controller-manager", "kubectl"):
        (bins / name).symlink_to(cluster.bin_dir / name)
    broken = bins / "kube-apiserver"
    broken.write_text("#!/bin/sh\necho 'E0000 flag provided but not defined: --kora-boom' >&2\nexit 1\n")
    broken.chmod(0o755)
    state = tmp_path / "state"
    with pytest.raises(ClusterError, match=r"(?s)kube-apiserver exited.*--kora-boom"):
        LocalCluster.start(state, bin_dir=bins)
    # etcd, started before the apiserver, was stopped again; no run dir or state is left
    assert not (state / "cluster.json").exists()
    assert not any((state / "cluster").glob("run-*"))
    etcd_cmd = f"--data-dir={state / 'cluster'}"
    assert not [p for p in Path("/proc").glob("[0-9]*") if etcd_cmd in _cmdline(p)]


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
