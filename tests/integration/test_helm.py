"""The Helm chart: lint, the rendered manifests/install.yaml, `helm install` into the local control
plane, and a `kubectl auth can-i` matrix for the operator's service account in both scopes."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from localcluster import wait_for
from operatorkit import Operator, apply, children, install_crds, job_status
from specs import valid_job

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/kora"
LOGS = Path("/tmp/kora-logs")
# what `make manifests` runs to write manifests/install.yaml
TEMPLATE_ARGS = ["template", "kora", str(CHART), "--namespace", "kora-system", "--include-crds"]


@pytest.fixture(scope="module")
def helm(cluster, tmp_path_factory):
    home = tmp_path_factory.mktemp("helm-home")
    env = {**cluster.env(), "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_DATA_HOME": str(home / "data")}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([str(cluster.bin_dir / "helm"), *args], capture_output=True, text=True, env=env,
                             timeout=120, check=False)
        if check and res.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {res.returncode}:\n{res.stderr}")
        return res
    return run


@pytest.mark.parametrize("scope", ["Cluster", "Namespace"])
def test_helm_lint_is_clean(helm, scope):
    out = helm("lint", "--strict", str(CHART), "--set", f"scope={scope}").stdout
    assert "0 chart(s) failed" in out and "[WARNING]" not in out and "[ERROR]" not in out


def test_values_schema_rejects_typos_and_bad_scopes(helm):
    assert "scope" in helm("lint", str(CHART), "--set", "scope=Everywhere", check=False).stdout
    res = helm("template", "x", str(CHART), "--set", "metrics.prot=1", check=False)
    assert res.returncode != 0 and "prot" in res.stderr


def test_install_yaml_matches_the_chart(helm):
    rendered = helm(*TEMPLATE_ARGS).stdout
    assert (ROOT / "manifests/install.yaml").read_text() == rendered, "run `make manifests` and commit the result"


def test_rendered_deployment_is_locked_down(helm):
    docs = [d for d in yaml.safe_load_all(helm(*TEMPLATE_ARGS).stdout) if d]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["args"] and "--metrics-port=9090" in c["args"]
    assert {d["kind"] for d in docs} >= {"CustomResourceDefinition", "ServiceAccount", "ClusterRole",
                                          "ClusterRoleBinding", "Deployment", "Service"}


def install(cluster, helm, release: str, ns: str, *sets: str) -> list[dict]:
    install_crds(cluster)  # helm skips CRDs that exist; other tests in this session may have made them
    cluster.kubectl("create", "namespace", ns)
    args = ["install", release, str(CHART), "--namespace", ns]
    for s in sets:
        args += ["--set", s]
    helm(*args)
    manifest = helm("get", "manifest", release, "--namespace", ns).stdout
    objs = [d for d in yaml.safe_load_all(manifest) if d]
    for o in objs:  # every object the chart rendered exists in the cluster
        where = ["-n", o["metadata"]["namespace"]] if o["metadata"].get("namespace") else []
        cluster.kubectl("get", o["kind"].lower(), o["metadata"]["name"], *where)
    return objs


def can_i(cluster, sa: str, verb: str, resource: str, ns: str | None) -> bool:
    """`resource` may name a subresource, `loratrainingjobs.kora.dev/status` (kubectl would read the part after
    the slash as an object's name)."""
    where = ["-n", ns] if ns else ["--all-namespaces"]
    resource, _, sub = resource.partition("/")
    subresource = [f"--subresource={sub}"] if sub else []
    res = cluster.kubectl("auth", "can-i", verb, resource, *subresource, *where, f"--as={sa}", check=False)
    return res.stdout.strip() == "yes"


# (verb, resource, namespace key) -> allowed? "own" is the watched namespace, "other" another one
NEEDED = [
    ("watch", "loratrainingjobs.kora.dev", "own"), ("patch", "loratrainingjobs.kora.dev", "own"),
    ("patch", "loratrainingjobs.kora.dev/status", "own"), ("create", "rayjobs.ray.io", "own"),
    ("patch", "rayjobs.ray.io", "own"), ("watch", "rayjobs.ray.io", "own"), ("create", "configmaps", "own"),
    ("get", "configmaps", "own"), ("create", "secrets", "own"), ("create", "events", "own"),
    ("watch", "loraadapters.kora.dev", "own"), ("patch", "loraadapters.kora.dev", "own"),
    ("patch", "loraadapters.kora.dev/status", "own"), ("update", "loratrainingjobs.kora.dev/finalizers", "own"),
]
FORBIDDEN = [
    ("delete", "nodes", None), ("get", "secrets", "own"), ("list", "secrets", "own"), ("get", "secrets", "other"),
    ("delete", "rayjobs.ray.io", "own"), ("delete", "loratrainingjobs.kora.dev", "own"),
    ("update", "loratrainingjobs.kora.dev", "own"), ("create", "pods", "own"), ("create", "clusterroles", None),
    ("create", "loraadapters.kora.dev", "own"), ("delete", "loraadapters.kora.dev", "own"),
    ("escalate", "roles", "own"), ("impersonate", "serviceaccounts", "own"),
]
CLUSTER_ONLY = [("create", "rayjobs.ray.io", "other"), ("list", "loratrainingjobs.kora.dev", None),
                ("create", "secrets", "other")]


def matrix(cluster, sa: str, own: str, other: str) -> dict[tuple[str, str, str | None], bool]:
    names = {"own": own, "other": other, None: None}
    return {(v, r, k): can_i(cluster, sa, v, r, names[k]) for v, r, k in NEEDED + FORBIDDEN + CLUSTER_ONLY}


def test_namespaced_install_grants_only_its_namespace(cluster, helm, tmp_path):
    ns, other = f"kora-ns-{uuid.uuid4().hex[:6]}", "default"
    objs = install(cluster, helm, "kora-ns", ns, "scope=Namespace")
    kinds = {o["kind"] for o in objs}
    assert kinds == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}
    sa = f"system:serviceaccount:{ns}:kora-ns"
    got = matrix(cluster, sa, ns, other)
    assert {k: v for k, v in got.items() if k in NEEDED and not v} == {}
    assert {k: v for k, v in got.items() if (k in FORBIDDEN or k in CLUSTER_ONLY) and v} == {}
    # and the rights are enough: the operator, run with this account's token, reconciles a job
    token = cluster.kubectl("create", "token", "kora-ns", "-n", ns, "--duration=1h").stdout.strip()
    kubeconfig = yaml.safe_load(cluster.kubeconfig.read_text())
    kubeconfig["users"] = [{"name": "sa", "user": {"token": token}}]
    kubeconfig["contexts"][0]["context"]["user"] = "sa"
    path = tmp_path / "sa.kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    op = Operator(cluster, [ns], LOGS / f"operator-sa-{ns}.log", kubeconfig=path).start()
    try:
        apply(cluster, valid_job("rbac"), ns)
        wait_for(lambda: all(len(v) == 1 for v in children(cluster, "rbac", ns).values()), timeout=30,
                 what="children made under the chart's RBAC")
        wait_for(lambda: job_status(cluster, "rbac", ns).get("phase") == "Pending", timeout=30, what="status")
        events = json.loads(cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"]
        assert any(e["reason"] == "CreatedRayJob" for e in events)
    finally:
        op.stop()
    assert "403" not in op.log.read_text() and "Forbidden" not in op.log.read_text()


def test_clusterwide_install_grants_every_namespace_but_nothing_else(cluster, helm):
    ns = f"kora-cw-{uuid.uuid4().hex[:6]}"
    objs = install(cluster, helm, f"kora-cw-{ns[-6:]}", ns)
    assert {o["kind"] for o in objs} >= {"ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"}
    sa = f"system:serviceaccount:{ns}:kora-cw-{ns[-6:]}"  # the release name holds "kora": it is the full name
    got = matrix(cluster, sa, ns, "default")
    assert {k: v for k, v in got.items() if (k in NEEDED or k in CLUSTER_ONLY) and not v} == {}
    assert {k: v for k, v in got.items() if k in FORBIDDEN and v} == {}
