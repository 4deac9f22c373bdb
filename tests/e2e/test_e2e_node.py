"""The product's path on a real node (issue 41 item 3; hack/e2e_node.py, `make e2e-node`): our images in pods —
`helm install charts/kora` (the operator as a pod), KubeRay's operator as a pod, `kubectl apply` of the KubeRay
sample -> RayJob -> RayCluster -> a head pod on the trainer-cpu image trains the toy to Succeeded.

One cluster and one job for the module (a cold image build and a node start are minutes on 2 cores): the head pod
is force-deleted once a checkpoint is on the volume, so the same run shows KubeRay's retry and the trainer's resume
from its LoRA-only checkpoint (no step trained twice, status.restarts 1); then the job is deleted and nothing of it
is left. Skipped, saying why, where the machine cannot run a node or build images (not root, a package missing).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import e2e_node
import images
import localnode
from localcluster import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.full, pytest.mark.timeout(3600)]
STEPS, INTERVAL = 200, 20


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Iterator[dict]:
    why = localnode.missing_prerequisites() + ([images.problem()] if images.problem() else [])
    if why:
        pytest.skip("cannot run a node or build images here: " + "; ".join(why))
    e = e2e_node.E2ENode(tmp_path_factory.mktemp("e2e-node"))
    try:
        built = e.build_images()
        e.up()
        e.import_images(built)
        e.install_kuberay()
        e.install_kora(built["operator"]["image"])
        e.make_volume()
        e.apply_job(STEPS, INTERVAL)
        e.wait(900, until=lambda st: st.get("phase") == "Running")
        pods = e.pods_wide()
        # while the job's pods all exist: the pods and the NetworkPolicies, to hold the policies' selectors to them
        snapshot = {kind: json.loads(e.kubectl("get", kind, "-A", "-o", "json").stdout)["items"]
                    for kind in ("pods", "networkpolicies", "namespaces")}
        killed, ckpt = e.kill_head()
        final = e.wait(1800)
        yield {"e": e, "final": final, "pods": pods, "killed": killed, "ckpt": ckpt, "built": built,
               "snapshot": snapshot}
    finally:
        e.down()
        assert localnode.leftovers(e.state_dir) == []


def test_our_images_run_as_pods_on_the_node(ran):
    pods = ran["pods"]
    assert re.search(r"kora-system\s+kora-\S+\s+1/1\s+Running", pods), pods
    assert re.search(r"kuberay-system\s+kuberay-operator-\S+\s+1/1\s+Running", pods), pods
    e = ran["e"]
    got = json.loads(e.kubectl("get", "pods", "-A", "-o", "json").stdout)["items"]
    by_image = {c["image"] for p in got for c in p["spec"]["containers"]}
    assert ran["built"]["operator"]["image"] in by_image
    assert e2e_node.kuberay_image_name() in by_image
    assert ran["built"]["trainer-cpu"]["image"] in by_image  # the head pod (retried) or the submitter


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_pods(peer: dict, snap: dict) -> list[str]:
    ns_ok = {n["metadata"]["name"] for n in snap["namespaces"]
             if _selects(peer.get("namespaceSelector") or {}, n["metadata"].get("labels") or {})}
    return [p["metadata"]["name"] for p in snap["pods"] if p["metadata"]["namespace"] in ns_ok
            and _selects(peer.get("podSelector") or {}, p["metadata"].get("labels") or {})]


def test_the_network_policies_select_the_real_pods(ran):
    """The bridge CNI enforces no NetworkPolicy (README): what can be checked here is that each policy's selectors
    pick the pods they mean on a real node — the job's own pods (head, submitter), our operator's pod on the
    control-plane port, KubeRay's operator pod on the dashboard port — and the chart's policy the operator pod."""
    snap = ran["snapshot"]
    policies = {p["metadata"]["name"]: p for p in snap["networkpolicies"]}
    job = policies[f"{e2e_node.JOB}-network-policy"]["spec"]
    own = {p["metadata"]["name"] for p in snap["pods"] if _selects(job["podSelector"], p["metadata"]["labels"])}
    assert any("-head-" in n for n in own), own
    by_port = {(r.get("ports") or [{}])[0].get("port"): _peer_pods(r["from"][0], snap) for r in job["ingress"]}
    assert by_port[None] and set(by_port[None]) == own  # the job's pods reach each other on every port
    assert [n for n in by_port[8068] if n.startswith("kora-")], by_port  # the operator: control plane only
    assert [n for n in by_port[8265] if n.startswith("kuberay-operator-")], by_port  # KubeRay: dashboard only
    chart = policies["kora"]["spec"]
    assert [p["metadata"]["name"] for p in snap["pods"]
            if p["metadata"]["namespace"] == e2e_node.KORA_NAMESPACE
            and _selects(chart["podSelector"], p["metadata"]["labels"])], chart


def test_the_job_succeeds_with_the_runtime_ray_conditions_and_events(ran):
    e, final = ran["e"], ran["final"]
    assert final["phase"] == "Succeeded", final
    assert final["progress"]["step"] == STEPS
    conds = {c["type"]: c for c in final["conditions"]}
    assert conds["PolicyServed"]["status"] == "True", conds
    assert conds["Complete"]["status"] == "True", conds
    desc = e.kubectl("describe", "ltj", e2e_node.JOB, "-n", e2e_node.NAMESPACE).stdout
    for reason in ("PolicyServed", "WeightsSynced", "Checkpointed"):
        assert reason in desc, desc
    table = e.kubectl("get", "ltj", "-n", e2e_node.NAMESPACE).stdout
    assert re.search(rf"{e2e_node.JOB}\s+Merge\s+Succeeded\s+{STEPS}\s", table), table  # NAME MODE PHASE STEP


def test_a_killed_head_pod_is_retried_and_resumes_from_its_checkpoint(ran):
    e, final = ran["e"], ran["final"]
    assert final.get("restarts") == 1, final
    logs = e2e_node.submitter_logs(e)
    resumed = re.findall(r"resumed from checkpoint step (\d+)", logs)
    assert resumed and int(resumed[-1]) >= ran["ckpt"], logs[-3000:]
    # after the resume, the first step trained is the one after the checkpoint: none is done twice
    after = logs[logs.rfind("resumed from checkpoint step"):]
    steps = [int(s) for s in re.findall(rf"\bstep (\d+)/{STEPS}\b", after)]
    assert steps and steps[0] == int(resumed[-1]) + 1, after[:3000]
    assert e.checkpoints()[-1] == STEPS


def test_deleting_the_job_leaves_nothing_of_it(ran):
    e = ran["e"]
    e.kubectl("delete", "ltj", e2e_node.JOB, "-n", e2e_node.NAMESPACE, "--wait=true", "--timeout=120s")
    label = f"kora.dev/job-name={e2e_node.JOB}"

    def gone() -> bool:
        for kind in ("pods", "rayjobs", "rayclusters", "secrets", "configmaps", "networkpolicies", "services",
                     "persistentvolumeclaims"):
            out = e.kubectl("get", kind, "-n", e2e_node.NAMESPACE, "-l", label, "-o", "name").stdout.strip()
            if out:
                return False
        # KubeRay's head Services carry its labels, not ours: none but the API server's may be left
        services = e.kubectl("get", "services", "-n", e2e_node.NAMESPACE, "-o", "name").stdout.split()
        return services == ["service/kubernetes"] and not e.kubectl(
            "get", "pods", "-n", e2e_node.NAMESPACE, "-o", "name").stdout.strip()

    wait_for(gone, timeout=180, interval=1, what=f"every object of {e2e_node.JOB} to go")
    # the checkpoints' claim is the user's (manifests/samples/volumes/), not the job's: it stays, with them
    assert e.kubectl("get", "pvc", "toy-kuberay-data", "-n", e2e_node.NAMESPACE, check=False).returncode == 0
    assert Path(e.volume / "checkpoints" / e2e_node.JOB).is_dir()
