"""The least-privilege children of a KubeRay job (SPEC "Security"): the engines' admin key Secret and how every
pod reads it, the per-job NetworkPolicy's selectors and ports, and the pods' security contexts."""

from __future__ import annotations

import pytest
import yaml
from test_builders import PEERS, job

from kora_operator.builders.children import build_children
from kora_operator.builders.configmap import build_config_map
from kora_operator.builders.names import engine_key_secret_name, network_policy_name
from kora_operator.builders.networkpolicy import DASHBOARD_PORT, KUBERAY_OPERATOR_LABELS, Peers, build_network_policy
from kora_operator.builders.rayjob import WRITABLE, build_ray_job
from kora_operator.builders.secret import ENGINE_ADMIN_KEY_ENV, ENGINE_KEY_KEY, build_engine_key_secret
from kora_operator.settings import Settings
from kora_trainer.config.control import CONTROL_PORT
from kora_trainer.config.ray_env import BOOTSTRAP_FILE, BOOTSTRAP_TEXT, IMAGE_RAY_HOME
from kora_trainer.wire.engine_auth import ADMIN_API_KEY_ENV

OWN = {"app.kubernetes.io/managed-by": "kora", "kora.dev/job-name": "demo"}


def templates(rj):
    """(component, pod template) of every pod the RayJob makes: head, workers, KubeRay's submitter."""
    spec = rj["spec"]
    rc = spec["rayClusterSpec"]
    return [("ray-head", rc["headGroupSpec"]["template"]),
            *(("ray-worker", g["template"]) for g in rc["workerGroupSpecs"]),
            ("ray-submitter", spec["submitterPodTemplate"])]


def test_the_engine_key_secret_holds_the_given_key_and_is_named_for_the_job():
    s = build_engine_key_secret(job(), "k" * 43)
    assert s["metadata"]["name"] == engine_key_secret_name("demo") == "demo-engine-admin-key"
    assert s["stringData"] == {ENGINE_KEY_KEY: "k" * 43} and s["type"] == "Opaque"
    assert s["metadata"]["labels"]["kora.dev/component"] == "engine-admin-key"


def test_the_key_the_builder_writes_is_the_only_thing_that_varies():
    # a reconcile offers a fresh key each time; everything else of every child is the same, so a Secret that
    # exists (create answers 409) keeps its key and nothing else would change
    a, b = build_children(job(), "t", "key-1", PEERS), build_children(job(), "t", "key-2", PEERS)
    diff = [(x["kind"], x["metadata"]["name"]) for x, y in zip(a, b, strict=True) if x != y]
    assert diff == [("Secret", "demo-engine-admin-key")]


def test_the_operator_and_the_trainer_name_the_same_variable():
    assert ENGINE_ADMIN_KEY_ENV == ADMIN_API_KEY_ENV


def test_every_ray_pod_reads_the_key_from_the_secret_and_the_submitter_does_not():
    for component, tmpl in templates(build_ray_job(job())):
        (c,) = tmpl["spec"]["containers"]
        refs = [e for e in c["env"] if e["name"] == ADMIN_API_KEY_ENV]
        if component == "ray-submitter":
            assert refs == []
            continue
        assert refs == [{"name": ADMIN_API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": "demo-engine-admin-key", "key": ENGINE_KEY_KEY}}}]
    assert ADMIN_API_KEY_ENV not in yaml.safe_dump(build_config_map(job()))


def test_the_network_policy_selects_the_jobs_pods_and_admits_only_its_peers():
    np = build_network_policy(job(), PEERS)
    assert np["metadata"]["name"] == network_policy_name("demo") == "demo-network-policy"
    spec = np["spec"]
    assert spec["podSelector"] == {"matchLabels": OWN} and spec["policyTypes"] == ["Ingress"]
    own, operator, kuberay = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": OWN}}]}  # no ports: Ray, engines, NCCL
    assert operator == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kora-system"}},
                                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kora",
                                                                  "app.kubernetes.io/instance": "kora"}}}],
                        "ports": [{"protocol": "TCP", "port": CONTROL_PORT}]}
    assert kuberay == {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": KUBERAY_OPERATOR_LABELS}}],
                       "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]}


def test_every_pod_the_policy_should_cover_carries_its_selector():
    for _, tmpl in templates(build_ray_job(job())):
        assert OWN.items() <= tmpl["metadata"]["labels"].items()


def test_an_operator_outside_a_pod_is_admitted_nowhere_and_kuberay_can_be_pinned():
    np = build_network_policy(job(), Peers(None, {}, "ray-system", {"app": "kuberay"}))
    own, kuberay = np["spec"]["ingress"]
    assert "ports" not in own
    assert kuberay["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray-system"}},
                                "podSelector": {"matchLabels": {"app": "kuberay"}}}]


def test_settings_switch_the_policy_and_say_whom_it_admits():
    assert Settings.from_env({"KORA_NETWORK_POLICY": "false"}).network_peers() is None
    assert [o["kind"] for o in build_children(job(), "t", "k", None)] == ["ConfigMap", "Secret", "Secret", "RayJob"]
    peers = Settings.from_env({"POD_NAMESPACE": "ops", "KORA_OPERATOR_POD_LABELS": "a=1, b=2",
                               "KORA_KUBERAY_OPERATOR_NAMESPACE": "ray"}).network_peers()
    assert peers == Peers("ops", {"a": "1", "b": "2"}, "ray", KUBERAY_OPERATOR_LABELS)
    assert Settings.from_env({}).network_peers() == Peers()  # on by default, the operator not in a pod
    with pytest.raises(ValueError, match="KEY=VALUE"):
        Settings.from_env({"KORA_OPERATOR_POD_LABELS": "novalue"})


def test_every_pod_runs_non_root_without_capabilities_on_a_read_only_root():
    for component, tmpl in templates(build_ray_job(job())):
        pod = tmpl["spec"]
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0 and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        (c,) = pod["containers"]
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}, component
        # what Ray and the trainer write lands on emptyDirs
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        for name, path in WRITABLE.items():
            assert vols[name] == {"name": name, "emptyDir": {}} and mounts[path]["name"] == name, component
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["HOME"] == IMAGE_RAY_HOME
        if component != "ray-submitter":  # Ray's bootstrap config, in the writable HOME, from the ConfigMap
            boot = mounts[f"{IMAGE_RAY_HOME}/{BOOTSTRAP_FILE}"]
            assert (boot["name"], boot["subPath"], boot["readOnly"]) == ("trainer-config", BOOTSTRAP_FILE, True)
    assert build_config_map(job())["data"][BOOTSTRAP_FILE] == BOOTSTRAP_TEXT


def test_the_submitter_is_kuberays_default_container_with_the_jobs_labels():
    sub = build_ray_job(job())["spec"]["submitterPodTemplate"]
    (c,) = sub["spec"]["containers"]
    assert (c["name"], c["image"], sub["spec"]["restartPolicy"]) == (
        "ray-job-submitter", "ghcr.io/kora-dev/kora-trainer:0.1.0", "Never")
    assert "command" not in c  # KubeRay writes its `ray job submit` command
    assert sub["metadata"]["labels"]["kora.dev/component"] == "ray-submitter"


def test_security_contexts_are_not_shared_objects():
    rj = build_ray_job(job())
    (_, head), (_, worker), _ = templates(rj)
    head["spec"]["securityContext"]["runAsUser"] = 0
    assert worker["spec"]["securityContext"]["runAsUser"] != 0
    assert "&id" not in yaml.safe_dump(build_ray_job(job()))  # no YAML anchors in `kora render`
