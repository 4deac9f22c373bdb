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
from operatorkit import Operator, all_children, apply, children, events, forbidden_in, install_crds, job_status
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
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # readiness too: `helm install --wait` passed on a crash-looping operator without it (issue 41, the real node)
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["args"] and "--metrics-port=9090" in c["args"]
    assert {d["kind"] for d in docs} >= {"CustomResourceDefinition", "ServiceAccount", "ClusterRole",
                                          "ClusterRoleBinding", "Deployment", "Service", "NetworkPolicy"}


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


def can_i(cluster, sa: str, verb: str, resource: str, name: str | None, ns: str | None) -> bool:
    """`resource` may name a subresource, `loratrainingjobs.kora.dev/status` (kubectl would read the part after
    the slash as an object's name, which is `name`)."""
    where = ["-n", ns] if ns else ["--all-namespaces"]
    resource, _, sub = resource.partition("/")
    subresource = [f"--subresource={sub}"] if sub else []
    what = f"{resource}/{name}" if name else resource
    res = cluster.kubectl("auth", "can-i", verb, what, *subresource, *where, f"--as={sa}", check=False)
    return res.stdout.strip() == "yes"


LTJ, LAD, RAYJOB, NETPOL = "loratrainingjobs.kora.dev", "loraadapters.kora.dev", "rayjobs.ray.io", \
    "networkpolicies.networking.k8s.io"
KEY = "<key-secret>"  # the operator key's Secret in the release namespace (kora.keySecretName)
BOTH, CLUSTER, NEITHER = (True, True), (False, True), (False, False)  # allowed under (Namespace, Cluster) scope
# The operator's whole account, both scopes: (verb, resource[/subresource], object name, namespace) -> allowed
# under scope=Namespace, under scope=Cluster. Namespace "own" is the watched (and release) namespace, "other"
# another one, None every namespace at once (--all-namespaces) or a cluster-scoped resource.
MATRIX: dict[tuple[str, str, str | None, str | None], tuple[bool, bool]] = {
    # the jobs: watched, kopf's annotations patched, status written through /status, never made or removed
    **{(v, LTJ, None, "own"): BOTH for v in ("get", "list", "watch", "patch")},
    **{(v, LTJ, None, ns): CLUSTER for v in ("list", "watch") for ns in ("other", None)},
    **{(v, LTJ, None, "own"): NEITHER for v in ("create", "update", "delete", "deletecollection")},
    ("get", f"{LTJ}/status", None, "own"): BOTH, ("patch", f"{LTJ}/status", None, "own"): BOTH,
    ("update", f"{LTJ}/status", None, "own"): NEITHER, ("patch", f"{LTJ}/status", None, "other"): CLUSTER,
    ("update", f"{LTJ}/finalizers", None, "own"): BOTH,  # blockOwnerDeletion on the children
    # the adapters: the same, never created or deleted
    **{(v, LAD, None, "own"): BOTH for v in ("get", "list", "watch", "patch")},
    **{(v, LAD, None, "own"): NEITHER for v in ("create", "update", "delete")},
    ("patch", f"{LAD}/status", None, "own"): BOTH, ("update", f"{LAD}/status", None, "own"): NEITHER,
    # the children: made, read back, the RayJob's lifecycle fields patched; the garbage collector deletes them
    **{(v, RAYJOB, None, "own"): BOTH for v in ("get", "list", "watch", "create", "patch")},
    ("create", RAYJOB, None, "other"): CLUSTER,
    **{(v, RAYJOB, None, "own"): NEITHER for v in ("update", "delete")},
    ("patch", f"{RAYJOB}/status", None, "own"): NEITHER,  # KubeRay's to write
    ("get", "configmaps", None, "own"): BOTH, ("create", "configmaps", None, "own"): BOTH,
    ("create", "configmaps", None, "other"): CLUSTER,
    **{(v, "configmaps", None, "own"): NEITHER for v in ("list", "update", "patch", "delete")},
    ("get", NETPOL, None, "own"): BOTH, ("create", NETPOL, None, "own"): BOTH,
    ("create", NETPOL, None, "other"): CLUSTER,
    **{(v, NETPOL, None, "own"): NEITHER for v in ("list", "watch", "update", "patch", "delete")},
    # Secrets: created (tokens, engine keys), never read, but for the operator key's own, by name
    ("create", "secrets", None, "own"): BOTH, ("create", "secrets", None, "other"): CLUSTER,
    ("get", "secrets", KEY, "own"): BOTH,
    ("get", "secrets", "some-jobs-control-token", "own"): NEITHER,
    **{(v, "secrets", None, ns): NEITHER for v in ("get", "list", "watch") for ns in ("own", "other", None)},
    **{(v, "secrets", None, "own"): NEITHER for v in ("update", "patch", "delete")},
    ("create", "events", None, "own"): BOTH, ("patch", "events", None, "own"): BOTH,
    ("create", "events.events.k8s.io", None, "own"): BOTH, ("delete", "events", None, "own"): NEITHER,
    # nothing of the pods it causes, nothing cluster-wide, no way to more rights
    **{(v, "pods", None, "own"): NEITHER for v in ("get", "list", "create", "delete")},
    ("create", "pods/exec", None, "own"): NEITHER, ("get", "pods/log", None, "own"): NEITHER,
    ("create", "services", None, "own"): NEITHER, ("create", "jobs.batch", None, "own"): NEITHER,
    ("list", "nodes", None, None): NEITHER, ("delete", "nodes", None, None): NEITHER,
    ("list", "namespaces", None, None): NEITHER, ("watch", "customresourcedefinitions.apiextensions.k8s.io", None,
                                                  None): NEITHER,
    ("create", "customresourcedefinitions.apiextensions.k8s.io", None, None): NEITHER,
    ("create", "clusterroles", None, None): NEITHER, ("create", "roles", None, "own"): NEITHER,
    ("create", "rolebindings", None, "own"): NEITHER, ("escalate", "roles", None, "own"): NEITHER,
    ("bind", "clusterroles", None, None): NEITHER, ("impersonate", "serviceaccounts", None, "own"): NEITHER,
    ("create", "serviceaccounts/token", None, "own"): NEITHER,
}


def check_matrix(cluster, sa: str, own: str, other: str, key_secret: str, scope: str) -> None:
    """Every row of MATRIX asked of the API server as `sa`; fails with every row whose answer differs."""
    names = {"own": own, "other": other, None: None}
    col = 0 if scope == "Namespace" else 1
    wrong = {}
    for (verb, resource, name, ns), want in MATRIX.items():
        got = can_i(cluster, sa, verb, resource, key_secret if name == KEY else name, names[ns])
        if got != want[col]:
            wrong[(verb, resource, name, ns)] = got
    assert wrong == {}, f"can-i answers that differ from MATRIX under scope={scope} (row: answer): {wrong}"


def test_the_matrix_asks_both_ways_in_both_scopes():
    # a matrix of only yeses (or only noes) would prove little: each scope has both, and the scopes differ
    for col in (0, 1):
        assert {want[col] for want in MATRIX.values()} == {True, False}
    assert any(a != b for a, b in MATRIX.values())
    assert any("/" in r for _, r, _, _ in MATRIX) and any(n for _, _, n, _ in MATRIX)


def test_network_policy_off_drops_the_policy_and_the_right(helm):
    def render(*sets: str) -> list[dict]:
        args = [*TEMPLATE_ARGS[:-1]] + [a for s in sets for a in ("--set", s)]
        return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]

    def operator_env(docs: list[dict]) -> dict:
        (dep,) = [d for d in docs if d["kind"] == "Deployment"]
        return {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}

    def netpol_rules(docs: list[dict]) -> list[dict]:
        roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
        return [r for d in roles for r in d["rules"] if "networkpolicies" in r["resources"]]

    on = render()
    assert [r["verbs"] for r in netpol_rules(on)] == [["get", "create"]]
    (policy,) = [d for d in on if d["kind"] == "NetworkPolicy"]
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == [8080, 9090]
    env = operator_env(on)
    assert env["KORA_NETWORK_POLICY"] == "true"
    assert env["KORA_OPERATOR_POD_LABELS"] == "app.kubernetes.io/instance=kora,app.kubernetes.io/name=kora"
    assert env["KORA_KUBERAY_OPERATOR_POD_LABELS"] == "app.kubernetes.io/name=kuberay-operator"
    off = render("networkPolicy.enabled=false")
    assert netpol_rules(off) == [] and not [d for d in off if d["kind"] == "NetworkPolicy"]
    assert operator_env(off)["KORA_NETWORK_POLICY"] == "false" and "POD_NAMESPACE" not in operator_env(off)
    (scraped,) = [d for d in render("networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=obs")
                  if d["kind"] == "NetworkPolicy"]
    assert scraped["spec"]["ingress"][1]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]


def test_namespaced_install_grants_only_its_namespace(cluster, helm, tmp_path):
    ns, other = f"kora-ns-{uuid.uuid4().hex[:6]}", "default"
    objs = install(cluster, helm, "kora-ns", ns, "scope=Namespace")
    kinds = {o["kind"] for o in objs}
    assert kinds == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "NetworkPolicy"}
    check_matrix(cluster, f"system:serviceaccount:{ns}:kora-ns", ns, other, "kora-ns-key", "Namespace")
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
        wait_for(lambda: all_children(children(cluster, "rbac", ns)), timeout=30,
                 what="children made under the chart's RBAC")
        wait_for(lambda: job_status(cluster, "rbac", ns).get("phase") == "Pending", timeout=30, what="status")
        # posted under the chart's RBAC, a moment after the status (kora_operator/events.py)
        made = events(cluster, "rbac", ns, wanting=["CreatedChildren"])
        assert any(e["reason"] == "CreatedChildren" and "RayJob rbac-ray" in e["message"] for e in made)
    finally:
        op.stop()
    assert not forbidden_in(op.log.read_text())


def test_clusterwide_install_grants_every_namespace_but_nothing_else(cluster, helm):
    ns = f"kora-cw-{uuid.uuid4().hex[:6]}"
    objs = install(cluster, helm, f"kora-cw-{ns[-6:]}", ns)
    assert {o["kind"] for o in objs} >= {"ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"}
    release = f"kora-cw-{ns[-6:]}"  # the release name holds "kora": it is the full name
    check_matrix(cluster, f"system:serviceaccount:{ns}:{release}", ns, "default", f"{release}-key", "Cluster")


MONITORING_ON = ["monitoring.serviceMonitor.enabled=true", "monitoring.serviceMonitor.labels.release=prom",
                 "monitoring.podMonitor.enabled=true", "monitoring.podMonitor.namespaces[0]=ml",
                 "monitoring.podMonitor.from[0].namespaceSelector.matchLabels.team=obs",
                 "monitoring.grafanaDashboard.enabled=true"]


def test_monitoring_is_off_by_default_and_renders_what_it_names_when_on(helm):
    """The ServiceMonitor selects the operator's metrics Service and its port; the PodMonitor selects the pods the
    operator builds for a job's Ray head (their labels, the control-plane port's name) and copies the job label the
    dashboard filters by; the scrapers are admitted to 8068 in the jobs' namespace; the dashboard ConfigMap carries
    dashboards/kora.json as it is, under Grafana's sidecar label."""
    from kora_operator.api.job import LoRATrainingJob
    from kora_operator.builders.rayjob import build_ray_job

    def render(*sets: str) -> list[dict]:
        args = [*TEMPLATE_ARGS[:-1]] + [a for s in sets for a in ("--set", s)]
        return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]

    kinds = ("ServiceMonitor", "PodMonitor", "ConfigMap")
    assert not [d for d in render() if d["kind"] in kinds]
    docs = render(*MONITORING_ON)
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in [p["name"] for p in svc["spec"]["ports"]]

    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    head = build_ray_job(LoRATrainingJob.model_validate(valid_job("mon")))["spec"]["rayClusterSpec"]["headGroupSpec"]
    head_labels, ports = head["template"]["metadata"]["labels"], head["template"]["spec"]["containers"][0]["ports"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= head_labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert {"name": endpoint["port"], "containerPort": 8068, "protocol": "TCP"} in ports
    assert pm["spec"]["podTargetLabels"] == ["kora.dev/job-name"] and "kora.dev/job-name" in head_labels
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}

    (allow,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["namespace"] == "ml"]
    assert allow["spec"]["podSelector"]["matchLabels"].items() <= head_labels.items()
    assert allow["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8068}],
                                         "from": [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]}]

    (dash,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["kora.json"]) == json.loads((CHART / "dashboards/kora.json").read_text())
    out = helm("lint", "--strict", str(CHART), *[a for s in MONITORING_ON for a in ("--set", s)]).stdout
    assert "0 chart(s) failed" in out and "[WARNING]" not in out
