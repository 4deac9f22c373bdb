"""What hack/e2e_node.py (`make e2e-node`) applies, checked without a node: KubeRay's operator pod carries the labels
the chart's NetworkPolicy admits to the Ray dashboard, runs locked down with small requests (a 2-core node), and the
toy's volume manifest is the sample's with the path replaced."""

from __future__ import annotations

from pathlib import Path

import yaml

import e2e_node

ROOT = Path(__file__).resolve().parents[2]
ROLE = "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: kuberay-operator}\nrules: []\n"


def test_the_kuberay_operator_pod_is_what_the_chart_and_the_job_policy_admit():
    docs = list(yaml.safe_load_all(e2e_node.kuberay_manifest("kora.local/kuberay-operator:v0", ROLE)))
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    chart = yaml.safe_load((ROOT / "charts/kora/values.yaml").read_text())["networkPolicy"]["kuberay"]["podLabels"]
    assert chart.items() <= labels.items()
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["imagePullPolicy"] == "IfNotPresent" and c["resources"]["requests"] == {"cpu": "50m", "memory": "128Mi"}
    assert "--enable-leader-election=false" in c["args"]
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    assert binding["subjects"][0] == {"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                      "namespace": e2e_node.KUBERAY_NAMESPACE}
    assert {d["kind"] for d in docs} == {"ClusterRole", "Namespace", "ServiceAccount", "ClusterRoleBinding",
                                         "Deployment"}


def test_the_volume_manifest_points_the_sample_pv_at_our_directory(tmp_path):
    pv, pvc = yaml.safe_load_all(e2e_node.volume_manifest(tmp_path / "vol"))
    assert pv["spec"]["hostPath"]["path"] == str(tmp_path / "vol")
    sample = yaml.safe_load(e2e_node.SAMPLE.read_text())
    assert pvc["metadata"]["name"] == sample["spec"]["model"]["volume"]["persistentVolumeClaim"]["claimName"]
    assert sample["spec"]["checkpoint"]["path"].startswith(sample["spec"]["model"]["volume"]["mountPath"] + "/")
