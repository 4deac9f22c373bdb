"""Helpers for tests that run the real operator (`kora operator`, a subprocess) against the local
control plane: the control plane itself, CRD installation (ours and KubeRay's), a namespace to work
in, the operator process, and object queries.

The context managers here are the bodies of the pytest fixtures of tests/integration/conftest.py and
tests/e2e/: one set-up, whichever directory a test lives in."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import LocalCluster, free_ports, wait_for

ROOT = Path(__file__).resolve().parents[1]
KORA = Path(sys.executable).with_name("kora")
CHILD_KINDS = {"configmaps": "ConfigMap", "secrets": "Secret", "networkpolicies.networking.k8s.io": "NetworkPolicy",
               "rayjobs.ray.io": "RayJob"}
# what a KubeRay job gets, by kind: its config, its control-plane token and engine admin key, its policy, its RayJob
KUBERAY_CHILDREN = {"ConfigMap": 1, "Secret": 2, "NetworkPolicy": 1, "RayJob": 1}
TEST_OPERATOR_KEY = "kora-test-operator-key-0123456789"
SKIP_ENV = "KORA_SKIP_CLUSTER"


@contextlib.contextmanager
def local_cluster(state_dir: Path) -> Iterator[LocalCluster]:
    """etcd + kube-apiserver + kube-controller-manager on 127.0.0.1 (hack/localcluster.py), stopped after.

    If the pinned binaries cannot be provided, this fails with hack/testbin.sh's error; it skips only
    when KORA_SKIP_CLUSTER=1 says so."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: not starting the local kube-apiserver/etcd/controller-manager")
    c = LocalCluster.start(state_dir)
    try:
        yield c
    finally:
        c.stop()


@contextlib.contextmanager
def kora_namespace(cluster: LocalCluster, prefix: str) -> Iterator[str]:
    """A fresh namespace `<prefix>-<random>`, with our CRDs and KubeRay's installed; deleted after."""
    install_crds(cluster)
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def install_crds(cluster: LocalCluster) -> None:
    """Our CRDs and KubeRay's (rayjobs is > 256 KiB: server-side apply, no last-applied annotation)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "manifests/crds"))
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(cluster.bin_dir / "kuberay-crds"))
    names = ["loratrainingjobs.kora.dev", "loraadapters.kora.dev", "rayjobs.ray.io", "rayclusters.ray.io"]
    # right after creation a CRD has no conditions yet and `kubectl wait` errors out: retry it
    wait_for(lambda: cluster.kubectl("wait", "--for=condition=Established", *[f"crd/{n}" for n in names],
                                     "--timeout=30s", check=False).returncode == 0, timeout=60, what="CRDs established")
    wait_for(lambda: cluster.kubectl("get", "ltj,rayjobs", "-A", check=False).returncode == 0,
             timeout=30, interval=0.3, what="ltj and rayjobs in discovery")


class Operator:
    """`kora operator` as a subprocess in its own session, stopped by its pid."""

    def __init__(self, cluster: LocalCluster, namespaces: list[str], log: Path, kubeconfig: Path | None = None,
                 env: dict[str, str] | None = None, args: list[str] | None = None) -> None:
        self.cluster, self.namespaces, self.log, self.kubeconfig = cluster, namespaces, log, kubeconfig
        self.extra_env, self.extra_args = env or {}, args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.liveness_port, self.metrics_port = free_ports(2)

    def start(self, timeout: float = 60) -> Operator:
        args = [str(KORA), "operator", "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz",
                "--metrics-port", str(self.metrics_port), "--metrics-address", "127.0.0.1"]
        for ns in self.namespaces:
            args += ["--namespace", ns]
        args += self.extra_args
        # a fixed operator key (tokens.py), so that tests never make one in ~/.local/state
        env = {**self.cluster.env(), "KORA_OPERATOR_KEY": TEST_OPERATOR_KEY, **self.extra_env}
        env["PYTHONUNBUFFERED"] = "1"
        if self.kubeconfig is not None:  # e.g. a service account's credentials instead of the admin's
            env["KUBECONFIG"] = str(self.kubeconfig)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        wait_for(self.healthy, timeout=timeout, interval=0.05, what=f"the operator's liveness (log {self.log})")
        return self

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"the operator exited {self.proc.returncode}; log:\n{self.log.read_text()[-3000:]}")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2) as r:
            return bool(r.status == 200)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies or the OOM killer strikes."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()

    @contextlib.contextmanager
    def running(self, timeout: float = 60) -> Iterator[Operator]:
        """Started (healthy) inside the block, stopped by its pid after it (also when it never got healthy)."""
        try:
            self.start(timeout)
            yield self
        finally:
            self.stop()


def get(cluster: LocalCluster, kind: str, name: str, ns: str) -> dict[str, Any] | None:
    res = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(res.stdout) if res.returncode == 0 else None


def children(cluster: LocalCluster, job: str, ns: str) -> dict[str, list[dict[str, Any]]]:
    """Every ConfigMap, Secret, NetworkPolicy and RayJob labelled as this job's, by kind."""
    out = cluster.kubectl("get", ",".join(CHILD_KINDS), "-n", ns, "-l", f"kora.dev/job-name={job}", "-o", "json")
    items = json.loads(out.stdout)["items"]
    return {kind: [i for i in items if i["kind"] == kind] for kind in CHILD_KINDS.values()}


def all_children(got: dict[str, list[dict[str, Any]]], want: dict[str, int] | None = None) -> bool:
    """`children` holds exactly what a KubeRay job gets (or `want`, by kind)."""
    return {kind: len(objs) for kind, objs in got.items()} == (want or KUBERAY_CHILDREN)


def apply(cluster: LocalCluster, doc: dict[str, Any], ns: str) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))


def patch_ray_status(cluster: LocalCluster, name: str, ns: str, status: dict[str, Any]) -> None:
    """Write the RayJob's status as KubeRay would (through its /status subresource)."""
    cluster.kubectl("patch", "rayjob", name, "-n", ns, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": status}))


def job_status(cluster: LocalCluster, name: str, ns: str) -> dict[str, Any]:
    got = get(cluster, "ltj", name, ns)
    return (got or {}).get("status") or {}


EVENT_WAIT = 30.0  # seconds an Event may come after what it tells of (the operator holds them back while busy)


def events(cluster: LocalCluster, name: str, ns: str, kind: str = "LoRATrainingJob",
           wanting: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The Events of one object; with `wanting`, once one of each of those reasons is among them. The operator
    posts Events behind its reconciles (kora_operator/events.py), like any controller's event recorder, so an
    Event may come a moment after the status change it tells of."""
    def read() -> list[dict[str, Any]]:
        out = cluster.kubectl("get", "events", "-n", ns, "--field-selector",
                              f"involvedObject.name={name},involvedObject.kind={kind}", "-o", "json")
        return list(json.loads(out.stdout)["items"])

    want = set(wanting)
    if not want:
        return read()
    def complete() -> list[dict[str, Any]] | None:
        got = read()
        return got if want <= {e["reason"] for e in got} else None

    return wait_for(complete, timeout=EVENT_WAIT, interval=0.2, what=f"events {sorted(want)} of {kind} {ns}/{name}")


def forbidden_in(log: str) -> list[str]:
    """The operator log's lines that tell of an API call refused: kopf's and the kubernetes client's errors say
    Forbidden, and an HTTP 403 is told in a status's shapes ("(403)", "'code': 403", an access log's `" 403 `).
    Not the digits alone: a random namespace (`tok-599403`) once failed CI that way, and a byte count or a
    millisecond could do the same."""
    shapes = re.compile(r"\(403\)|code['\"]?: ?403\b|\" 403 |\b403, message")
    return [line for line in log.splitlines() if "Forbidden" in line or shapes.search(line)]


class Watch:
    """`kubectl get ltj -w` on one job (started before it exists): every version of its status that the
    API server stored, as (phase, progress.step, restarts) rows — no transition is missed between polls.
    The kubectl process is this object's own, stopped by its pid."""

    # ";"-separated: kubectl aligns tab-separated jsonpath output into columns of spaces
    TEMPLATE = '{.status.phase}{";"}{.status.progress.step}{";"}{.status.restarts}{"\\n"}'

    def __init__(self, cluster: LocalCluster, name: str, ns: str) -> None:
        cmd = [str(cluster.bin_dir / "kubectl"), "get", "ltj", "-n", ns, "--field-selector",
               f"metadata.name={name}", "--watch", "-o", f"jsonpath={self.TEMPLATE}"]
        self.rows: list[tuple[str, int | None, int]] = []
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, env=cluster.env())
        self._thread = threading.Thread(target=self._read, name=f"watch-{name}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            phase, step, restarts = [*line.strip().split(";"), "", "", ""][:3]
            self.rows.append((phase, int(step) if step else None, int(restarts) if restarts else 0))

    def phases(self) -> list[str]:
        """The phases in the order they were stored, repeats folded."""
        out: list[str] = []
        for phase, _, _ in self.rows:
            if phase and (not out or out[-1] != phase):
                out.append(phase)
        return out

    def steps(self, restarts: int | None = None) -> list[int]:
        """progress.step in every stored version (of the attempt after `restarts` restarts, if given)."""
        return [s for _, s, r in self.rows if s is not None and (restarts is None or r == restarts)]

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._thread.join(timeout=10)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
