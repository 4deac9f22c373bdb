"""The operator (`kora operator`, a real subprocess) against the real API server with KubeRay's CRDs.

KubeRay's controller does not run here (test_kuberay.py runs it): these tests write the RayJob's
status themselves, as KubeRay would, and watch the LoRATrainingJob follow.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import yaml

from kora_operator.api.crd import loratrainingjob_crd
from kora_operator.api.rules import JOB_RULES
from kora_operator.builders.ncclenv import NCCL_ENV
from kora_operator.validation import validate_job
from localcluster import wait_for
from operatorkit import Operator, all_children, apply, children, events, get, install_crds, job_status, patch_ray_status
from specs import set_path, valid_job

ROOT = Path(__file__).resolve().parents[2]
# KubeRay samples: each becomes a RayJob (runtime Ray samples, like toy-local, are covered by test_runtime_ray)
SAMPLES = sorted(p for p in (ROOT / "manifests/samples").glob("*.yaml") if "kind: Ray\n" not in p.read_text())
LOGS = Path("/tmp/kora-logs")
WAIT = 30


@pytest.fixture(scope="module")
def ns(cluster):
    install_crds(cluster)
    name = f"op-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(cluster, ns):
    op = Operator(cluster, [ns], LOGS / f"operator-{ns}.log").start()
    yield op
    op.stop()


def wait_phase(cluster, name, ns, phase):
    return wait_for(lambda: (s := job_status(cluster, name, ns)).get("phase") == phase and s,
                    timeout=WAIT, interval=0.2, what=f"ltj {name} phase {phase} (now {job_status(cluster, name, ns)})")


def wait_children(cluster, name, ns):
    def one_each():
        got = children(cluster, name, ns)
        return got if all_children(got) else None
    return wait_for(one_each, timeout=WAIT, interval=0.2, what=f"the children of {name}")


def condition(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def reasons(cluster, name, ns, *wanting):
    return [(e["type"], e["reason"]) for e in events(cluster, name, ns, wanting=wanting)]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_each_sample_gets_exactly_its_configmap_secrets_policy_and_rayjob(cluster, ns, operator, sample):
    doc = yaml.safe_load(sample.read_text())
    name = doc["metadata"]["name"]
    cluster.kubectl("apply", "-n", ns, "-f", str(sample))
    kids = wait_children(cluster, name, ns)
    uid = get(cluster, "ltj", name, ns)["metadata"]["uid"]
    for obj in (o for objs in kids.values() for o in objs):
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("LoRATrainingJob", name, uid, True)
    (rayjob,) = kids["RayJob"]
    # the API server accepted it against KubeRay's own schema; KubeRay's defaults were applied
    assert rayjob["spec"]["submissionMode"] == "K8sJobMode"
    assert rayjob["spec"]["entrypoint"] == "python -m kora_trainer.train --config /etc/kora/job.yaml"
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert 8068 in [p["containerPort"] for p in head["ports"]]
    secret, key = sorted(kids["Secret"], key=lambda s: "key" in s["data"])
    assert len(secret["data"]["token"]) > 40  # base64 of a real token, not the render placeholder
    assert len(key["data"]["key"]) > 40
    status = wait_phase(cluster, name, ns, "Pending")
    assert condition(status, "Validated")["status"] == "True"
    assert status["rayJobName"] == rayjob["metadata"]["name"]
    assert status["syncMode"] == doc["spec"]["lora"].get("syncMode", "Merge")
    got = reasons(cluster, name, ns, "Validated", "CreatedChildren")
    assert ("Normal", "Validated") in got, got
    # one Event for the five children the first reconcile made (one API write, not five), naming each
    (made,) = [e["message"] for e in events(cluster, name, ns) if e["reason"] == "CreatedChildren"]
    for obj in (o for objs in kids.values() for o in objs):
        assert f"{obj['kind']} {obj['metadata']['name']}" in made, made


def test_the_operator_writes_a_job_it_reconciles_through_its_status_only(cluster, ns, operator):
    # the job's metadata is the user's: kopf's bookkeeping (its diff base, its handlers' progress) stays out of
    # it while handlers succeed (handlers/kopf_state.py), and the status is written through /status
    apply(cluster, valid_job("untouched"), ns)
    wait_children(cluster, "untouched", ns)
    wait_phase(cluster, "untouched", ns, "Pending")
    meta = json.loads(cluster.kubectl("get", "ltj", "untouched", "-n", ns, "-o", "json",
                                      "--show-managed-fields").stdout)["metadata"]
    assert not [a for a in meta.get("annotations") or {} if a.startswith("kora.dev/")], meta.get("annotations")
    writers = {(m["manager"], m.get("subresource", "")) for m in meta["managedFields"]}
    assert {w for w in writers if not w[0].startswith("kubectl")} <= {(m, "status") for m, _ in writers}, writers


def test_status_follows_the_rayjob_to_succeeded(cluster, ns, operator):
    apply(cluster, valid_job("happy", lora={"rank": 8, "syncMode": "Adapter"}), ns)
    rj = wait_children(cluster, "happy", ns)["RayJob"][0]["metadata"]["name"]
    wait_phase(cluster, "happy", ns, "Pending")
    patch_ray_status(cluster, rj, ns, {"jobDeploymentStatus": "Initializing", "rayClusterName": f"{rj}-x7k2p",
                                       "startTime": "2026-11-30T10:00:00Z"})
    s = wait_phase(cluster, "happy", ns, "Provisioning")
    assert condition(s, "ClusterReady")["reason"] == "ClusterProvisioning"
    assert s["rayClusterName"] == f"{rj}-x7k2p" and s["startTime"] == "2026-11-30T10:00:00Z"
    patch_ray_status(cluster, rj, ns, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING",
                                       "dashboardURL": f"{rj}-x7k2p-head-svc.{ns}.svc.cluster.local:8265"})
    s = wait_phase(cluster, "happy", ns, "Running")
    ready_at = condition(s, "ClusterReady")["lastTransitionTime"]
    assert condition(s, "ClusterReady")["status"] == "True" and condition(s, "Training")["status"] == "True"
    assert s["dashboardURL"].endswith(":8265")
    row = cluster.kubectl("get", "ltj", "happy", "-n", ns, "--no-headers").stdout.split()
    assert row[:3] == ["happy", "Adapter", "Running"]
    patch_ray_status(cluster, rj, ns, {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED",
                                       "endTime": "2026-11-30T11:00:00Z"})
    s = wait_phase(cluster, "happy", ns, "Succeeded")
    assert condition(s, "Complete")["status"] == "True" and s["completionTime"] == "2026-11-30T11:00:00Z"
    assert condition(s, "ClusterReady")["lastTransitionTime"] >= ready_at
    got = reasons(cluster, "happy", ns, "ClusterProvisioning", "ClusterReady", "TrainerRunning", "Succeeded")
    for r in ("ClusterProvisioning", "ClusterReady", "TrainerRunning", "Succeeded"):
        assert ("Normal", r) in got, got
    describe = cluster.kubectl("describe", "ltj", "happy", "-n", ns).stdout
    LOGS.mkdir(exist_ok=True)
    (LOGS / "describe-ltj-succeeded.txt").write_text(describe)
    assert "Phase:" in describe and "Succeeded" in describe and f"RayJob {rj}" in describe


def test_a_failed_rayjob_fails_the_job_with_a_warning(cluster, ns, operator):
    apply(cluster, valid_job("sad"), ns)
    rj = wait_children(cluster, "sad", ns)["RayJob"][0]["metadata"]["name"]
    patch_ray_status(cluster, rj, ns, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
    wait_phase(cluster, "sad", ns, "Running")
    patch_ray_status(cluster, rj, ns, {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed",
                                       "message": "Job entrypoint command failed with exit code 1", "failed": 1})
    s = wait_phase(cluster, "sad", ns, "Failed")
    failed = condition(s, "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "TrainerFailed")
    assert "exit code 1" in failed["message"]
    assert ("Warning", "TrainerFailed") in reasons(cluster, "sad", ns, "TrainerFailed")


def test_an_invalid_spec_fails_validation_and_gets_no_rayjob(cluster, ns, operator, tmp_path):
    # rule 4 needs the model's config.json, so the CRD cannot check it; the operator (which can
    # read this path, being a local process here) can
    model = tmp_path / "vl-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}))
    doc = valid_job("vl-bad", lora={"rank": 8, "syncMode": "Adapter", "scope": "all"})
    doc["spec"]["model"]["path"] = str(model)
    apply(cluster, doc, ns)
    s = wait_phase(cluster, "vl-bad", ns, "Failed")
    validated = condition(s, "Validated")
    assert (validated["status"], validated["reason"]) == ("False", "ValidationFailed")
    assert "lora.scope" in validated["message"]
    assert ("Warning", "ValidationFailed") in reasons(cluster, "vl-bad", ns, "ValidationFailed")
    assert all(v == [] for v in children(cluster, "vl-bad", ns).values())


def test_a_job_too_big_for_its_workers_is_refused_and_one_that_fits_gets_them(cluster, ns, operator):
    too_big = valid_job("too-big", parallelism={"data": 16})  # 16 trainer ranks on 1 worker x 8 GPUs
    (message,) = [p.message for p in validate_job(too_big)[1] if p.severity == "error"]
    assert "needs 16 GPUs" in message and "the cluster has 8 (1 node)" in message
    res = cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(too_big), check=False)
    assert res.returncode != 0 and message in res.stderr, res.stderr  # refused at apply, by the CRD's CEL
    assert get(cluster, "ltj", "too-big", ns) is None
    # the fix the message names: two workers
    fits = set_path(too_big, "resources.workers", 2)
    fits["metadata"]["name"] = "fits"
    apply(cluster, fits, ns)
    (rayjob,) = wait_children(cluster, "fits", ns)["RayJob"]
    rc = rayjob["spec"]["rayClusterSpec"]  # as the API server stored it against KubeRay's schema
    (group,) = rc["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 2)
    assert group["rayStartParams"]["num-gpus"] == "8"
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert rc["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    for tmpl in (rc["headGroupSpec"]["template"], group["template"]):
        env = {e["name"]: e.get("value") for e in tmpl["spec"]["containers"][0]["env"]}
        assert {k: env[k] for k in NCCL_ENV} == NCCL_ENV
    assert condition(wait_phase(cluster, "fits", ns, "Pending"), "Validated")["status"] == "True"


def test_a_stored_job_that_does_not_fit_fails_validation_and_gets_no_rayjob(cluster, ns, operator):
    """A job the API server took before the CRD had the fit rules (an older kora's CRD; ratcheting keeps it) is
    the operator's to refuse: ValidationFailed, naming the field, the numbers and the fix; no RayJob."""
    crd = loratrainingjob_crd()
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    fit = {r.message for r in JOB_RULES if r.id.startswith("kuberay-")}
    spec["x-kubernetes-validations"] = [v for v in spec["x-kubernetes-validations"] if v["message"] not in fit]
    doc = valid_job("stored-too-big", parallelism={"data": 16})
    (problem,) = [p for p in validate_job(doc)[1] if p.severity == "error"]
    try:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump(crd))
        # the API server's handlers take the changed schema a moment after the apply: create until it is taken
        wait_for(lambda: cluster.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(doc),
                                         check=False).returncode == 0, timeout=WAIT, interval=0.3,
                 what="the CRD without its fit rules to take the job")
    finally:
        install_crds(cluster)  # the CRD as generated, with every rule
    s = wait_phase(cluster, "stored-too-big", ns, "Failed")
    validated = condition(s, "Validated")
    assert (validated["status"], validated["reason"]) == ("False", "ValidationFailed")
    assert validated["message"] == f"{problem.field}: {problem.message}"
    assert ("Warning", "ValidationFailed") in reasons(cluster, "stored-too-big", ns, "ValidationFailed")
    assert all(v == [] for v in children(cluster, "stored-too-big", ns).values())


def test_unset_sync_mode_warns_and_uses_merge(cluster, ns, operator):
    doc = valid_job("nomode")
    del doc["spec"]["lora"]["syncMode"]
    apply(cluster, doc, ns)
    wait_children(cluster, "nomode", ns)
    # the status is written behind the reconcile that made the children (statuses.py): wait for it
    wait_for(lambda: job_status(cluster, "nomode", ns).get("syncMode") == "Merge", timeout=WAIT,
             what=f"status.syncMode Merge (now {job_status(cluster, 'nomode', ns)})")
    wait_for(lambda: ("Warning", "SyncModeDefaulted") in reasons(cluster, "nomode", ns), timeout=WAIT,
             what="a SyncModeDefaulted warning")


def test_suspend_and_lifecycle_fields_reach_the_rayjob(cluster, ns, operator):
    doc = valid_job("pause")
    apply(cluster, doc, ns)
    rj = wait_children(cluster, "pause", ns)["RayJob"][0]["metadata"]["name"]
    apply(cluster, set_path(set_path(doc, "suspend", True), "backoffLimit", 2), ns)
    wait_for(lambda: get(cluster, "rayjob", rj, ns)["spec"]["suspend"] is True, timeout=WAIT, what="suspended RayJob")
    assert get(cluster, "rayjob", rj, ns)["spec"]["backoffLimit"] == 2
    s = wait_phase(cluster, "pause", ns, "Suspended")
    assert condition(s, "ClusterReady")["reason"] == "Suspended"
    patch_ray_status(cluster, rj, ns, {"jobDeploymentStatus": "Suspended"})
    apply(cluster, set_path(doc, "backoffLimit", 2), ns)  # resume
    wait_for(lambda: get(cluster, "rayjob", rj, ns)["spec"]["suspend"] is False, timeout=WAIT, what="resumed RayJob")
    s = wait_phase(cluster, "pause", ns, "Provisioning")
    assert condition(s, "ClusterReady")["reason"] == "Resuming"
    assert ("Normal", "UpdatedRayJob") in reasons(cluster, "pause", ns, "UpdatedRayJob")


def test_a_deleted_rayjob_is_recreated(cluster, ns, operator):
    apply(cluster, valid_job("phoenix"), ns)
    old = wait_children(cluster, "phoenix", ns)["RayJob"][0]["metadata"]
    cluster.kubectl("delete", "rayjob", old["name"], "-n", ns)
    wait_for(lambda: (r := get(cluster, "rayjob", old["name"], ns)) and r["metadata"]["uid"] != old["uid"],
             timeout=WAIT, what="the RayJob to come back")
    # only the RayJob was missing: its own Event says so
    wait_for(lambda: ("Normal", "CreatedRayJob") in reasons(cluster, "phoenix", ns), timeout=WAIT,
             what="the CreatedRayJob event")


def test_deleting_the_job_garbage_collects_its_children(cluster, ns, operator):
    apply(cluster, valid_job("doomed"), ns)
    wait_children(cluster, "doomed", ns)
    cluster.kubectl("delete", "ltj", "doomed", "-n", ns, "--wait=true", "--timeout=30s")
    wait_for(lambda: all(v == [] for v in children(cluster, "doomed", ns).values()), timeout=60, interval=0.5,
             what="kube-controller-manager's garbage collector to remove the children")


def test_metrics_count_reconciles(operator):
    wait_for(lambda: 'kora_reconciles_total{result="success"' in operator.metrics()
             or 'result="success",trigger=' in operator.metrics(), timeout=WAIT, what="reconcile metrics")
    text = operator.metrics()
    assert "kora_reconcile_duration_seconds_bucket" in text and "kora_children_created_total" in text


def test_cluster_shape_cannot_change_on_a_created_job(cluster, ns, operator):
    doc = valid_job("frozen")
    apply(cluster, doc, ns)
    res = cluster.kubectl("apply", "-n", ns, "-f", "-", check=False,
                          input=yaml.safe_dump(set_path(doc, "resources.workers", 4)))
    assert res.returncode != 0 and "spec.resources is immutable" in res.stderr


def test_a_deleted_configmap_and_secret_are_made_again_once_the_recheck_time_has_passed(cluster, namespace):
    # the children a reconcile knows to exist are not checked for KORA_CHILDREN_RECHECK seconds (handlers/memory.py):
    # a ConfigMap or Secret a user deletes comes back at the first reconcile after that (here a RayJob change)
    install_crds(cluster)
    op = Operator(cluster, [namespace], LOGS / f"operator-{namespace}.log", env={"KORA_CHILDREN_RECHECK": "1"}).start()
    try:
        apply(cluster, valid_job("mend"), namespace)
        kids = wait_children(cluster, "mend", namespace)
        (cm,) = kids["ConfigMap"]
        token = next(s for s in kids["Secret"] if "token" in s["data"])
        rj = kids["RayJob"][0]["metadata"]["name"]
        cluster.kubectl("delete", f"configmap/{cm['metadata']['name']}", f"secret/{token['metadata']['name']}",
                        "-n", namespace)
        nudges = iter(range(10**6))

        def made_again():
            # each status change of the RayJob is a watch event, hence a reconcile
            patch_ray_status(cluster, rj, namespace, {"message": f"nudge {next(nudges)}"})
            got = children(cluster, "mend", namespace)
            return all_children(got) and got["ConfigMap"][0]["metadata"]["uid"] != cm["metadata"]["uid"]

        wait_for(made_again, timeout=WAIT, interval=0.5, what="the deleted ConfigMap and Secret made again")

        def remade():  # the Event comes a moment after the children (kora_operator/events.py)
            return any(f"ConfigMap {cm['metadata']['name']}, Secret {token['metadata']['name']}" in e["message"]
                       and "RayJob" not in e["message"] for e in events(cluster, "mend", namespace)
                       if e["reason"] == "CreatedChildren")

        wait_for(remade, timeout=WAIT, what="a CreatedChildren event naming the ConfigMap and Secret made again")
    finally:
        op.stop()
