"""Least privilege on the real API server (SPEC "Security"): the operator (`kora operator`, a subprocess) makes
each KubeRay job's engine admin key Secret and NetworkPolicy; the API server stores them as built (its own
validation of the NetworkPolicy passed), the key never changes while its Secret lives, the RayJob's pods read
the key and run locked down. That deleting the job lets kube-controller-manager's garbage collector take them
(with the job's other children) is test_operator.py's test_deleting_the_job_garbage_collects_its_children.
No network plugin runs here, so the policy is checked as the API server holds it, not by sending packets.
"""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path

import pytest

from localcluster import wait_for
from operatorkit import Operator, all_children, apply, children, get, install_crds
from specs import valid_job

LOGS = Path("/tmp/kora-logs")
WAIT = 30
OPERATOR_ENV = {"POD_NAMESPACE": "kora-system", "KORA_OPERATOR_POD_LABELS": "app.kubernetes.io/name=kora",
                "KORA_KUBERAY_OPERATOR_NAMESPACE": "ray-system"}


def namespace(cluster, prefix):
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    return name


@pytest.fixture(scope="module")
def ns(cluster):
    install_crds(cluster)
    name = namespace(cluster, "lp")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(cluster, ns):
    # as the chart runs it: told its own namespace and labels (here made up: it runs outside a pod)
    with Operator(cluster, [ns], LOGS / f"operator-{ns}.log", env=OPERATOR_ENV).running() as op:
        yield op


def wait_children(cluster, name, ns, want=None):
    def made():
        got = children(cluster, name, ns)
        return got if all_children(got, want) else None
    return wait_for(made, timeout=WAIT, interval=0.2, what=f"the children of {name}")


def engine_key(kids):
    (secret,) = [s for s in kids["Secret"] if s["metadata"]["labels"]["kora.dev/component"] == "engine-admin-key"]
    return secret


def test_the_engine_key_is_a_random_owned_secret_that_survives_reconciles(cluster, ns, operator):
    apply(cluster, valid_job("keyed"), ns)
    kids = wait_children(cluster, "keyed", ns)
    secret = engine_key(kids)
    uid = get(cluster, "ltj", "keyed", ns)["metadata"]["uid"]
    assert secret["metadata"]["name"] == "keyed-engine-admin-key"
    assert [(o["kind"], o["uid"], o["controller"]) for o in secret["metadata"]["ownerReferences"]] == [
        ("LoRATrainingJob", uid, True)]
    key = base64.b64decode(secret["data"]["key"]).decode()
    assert len(key) >= 43 and key != "<random-made-by-the-operator-at-create-time>"
    # reconciles that each offer a fresh key: a spec change, and a deleted RayJob brought back
    cluster.kubectl("patch", "ltj", "keyed", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"suspend": True}}))
    rayjob = kids["RayJob"][0]["metadata"]
    wait_for(lambda: get(cluster, "rayjob", rayjob["name"], ns)["spec"]["suspend"] is True, timeout=WAIT,
             what="the suspend to reach the RayJob")
    cluster.kubectl("delete", "rayjob", rayjob["name"], "-n", ns)
    wait_for(lambda: (r := get(cluster, "rayjob", rayjob["name"], ns)) and r["metadata"]["uid"] != rayjob["uid"],
             timeout=WAIT, what="the RayJob to come back")
    again = engine_key(children(cluster, "keyed", ns))
    assert again["data"] == secret["data"]
    assert again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]  # never written again
    # a second job gets a key of its own
    apply(cluster, valid_job("keyed-2"), ns)
    assert engine_key(wait_children(cluster, "keyed-2", ns))["data"] != secret["data"]


def test_the_network_policy_the_api_server_holds_admits_only_the_jobs_peers(cluster, ns, operator):
    apply(cluster, valid_job("fenced"), ns)
    kids = wait_children(cluster, "fenced", ns)
    (np,) = kids["NetworkPolicy"]
    uid = get(cluster, "ltj", "fenced", ns)["metadata"]["uid"]
    assert [(o["kind"], o["uid"]) for o in np["metadata"]["ownerReferences"]] == [("LoRATrainingJob", uid)]
    own = {"matchLabels": {"app.kubernetes.io/managed-by": "kora", "kora.dev/job-name": "fenced"}}
    assert np["spec"]["podSelector"] == own and np["spec"]["policyTypes"] == ["Ingress"]
    assert np["spec"]["ingress"] == [
        {"from": [{"podSelector": own}]},
        {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kora-system"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kora"}}}],
         "ports": [{"protocol": "TCP", "port": 8068}]},
        {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray-system"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}],
         "ports": [{"protocol": "TCP", "port": 8265}]},
    ]
    # every pod the RayJob makes carries the policy's selector (the API server kept the templates as built)
    spec = kids["RayJob"][0]["spec"]
    rc = spec["rayClusterSpec"]
    templates = [rc["headGroupSpec"]["template"], *(g["template"] for g in rc["workerGroupSpecs"]),
                 spec["submitterPodTemplate"]]
    assert len(templates) == 3
    for tmpl in templates:
        assert own["matchLabels"].items() <= tmpl["metadata"]["labels"].items()


def test_the_rayjob_pods_read_the_key_and_run_locked_down(cluster, ns, operator):
    apply(cluster, valid_job("locked"), ns)
    spec = wait_children(cluster, "locked", ns)["RayJob"][0]["spec"]
    rc = spec["rayClusterSpec"]
    ray_pods = [rc["headGroupSpec"]["template"], *(g["template"] for g in rc["workerGroupSpecs"])]
    for tmpl in [*ray_pods, spec["submitterPodTemplate"]]:
        pod = tmpl["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (c,) = pod["containers"]
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/home/kora", "/workspace"}
        keys = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "KORA_ENGINE_ADMIN_API_KEY"]
        assert keys == ([{"name": "locked-engine-admin-key", "key": "key"}] if tmpl in ray_pods else [])


def test_an_operator_told_no_network_policy_makes_none(cluster):
    install_crds(cluster)
    ns = namespace(cluster, "lp-off")
    try:
        with Operator(cluster, [ns], LOGS / f"operator-{ns}.log", args=["--no-network-policy"]).running():
            apply(cluster, valid_job("open"), ns)
            kids = wait_children(cluster, "open", ns, {"ConfigMap": 1, "Secret": 2, "NetworkPolicy": 0, "RayJob": 1})
            assert engine_key(kids)  # the key does not depend on the policy
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
