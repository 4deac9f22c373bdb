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
        killed, ckpt = e.kill_head()
        final = e.wait(1800)
        yield {"e": e, "final": final, "pods": pods, "killed": killed, "ckpt": ckpt, "built": built}
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
    assert re.search(rf"{e2e_node.JOB}\s+Succeeded", table), table


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
