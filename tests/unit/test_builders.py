"""The pure builders: ConfigMap, Secret and RayJob from a LoRATrainingJob."""

from __future__ import annotations

import re

import pytest
import yaml

from kora_operator.builders.children import build_children
from kora_operator.builders.configmap import build_config_map
from kora_operator.builders.names import MAX_RAYJOB_NAME, ray_job_name, secret_name
from kora_operator.builders.ncclenv import NCCL_ENV
from kora_operator.builders.networkpolicy import Peers
from kora_operator.builders.rayjob import CONTROL_PORT, ENTRYPOINT, build_ray_job, mutable_spec
from kora_operator.builders.secret import build_secret, new_token
from kora_operator.reasons import CREATED, FAILED_TO_CREATE
from kora_operator.validation import validate_job
from kora_trainer.config import ModelSpec
from specs import set_path, valid_job

UID = "0b8c7d52-1111-4222-8333-444455556666"
PEERS = Peers("kora-system", {"app.kubernetes.io/name": "kora", "app.kubernetes.io/instance": "kora"})


def job(doc=None, **meta):
    doc = doc or valid_job("demo")
    doc["metadata"].update({"namespace": "team-a", "uid": UID, **meta})
    parsed, problems = validate_job(doc)
    assert parsed is not None and not [p for p in problems if p.severity == "error"], problems
    return parsed


def container(pod_template):
    (c,) = pod_template["spec"]["containers"]
    return c


def test_every_child_is_owned_by_the_job_and_labelled():
    for obj in build_children(job(), "tok", "key", PEERS):
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        (owner,) = meta["ownerReferences"]
        assert owner == {"apiVersion": "kora.dev/v1alpha1", "kind": "LoRATrainingJob", "name": "demo",
                         "uid": UID, "controller": True, "blockOwnerDeletion": True}
        assert meta["labels"]["kora.dev/job-name"] == "demo"
        assert meta["labels"]["kora.dev/component"]
    kinds = [o["kind"] for o in build_children(job(), "tok", "key", PEERS)]
    assert kinds == ["ConfigMap", "Secret", "Secret", "NetworkPolicy", "RayJob"]


def test_every_child_kind_has_its_event_reasons():
    # the reasons `kubectl describe` lists for a child's creation, one Reason member per kind
    for kind in (o["kind"] for o in build_children(job(), "tok", "key", PEERS)):
        assert (CREATED[kind], FAILED_TO_CREATE[kind]) == (f"Created{kind}", f"FailedToCreate{kind}")


def test_no_owner_reference_without_a_uid():
    parsed, _ = validate_job(valid_job("demo"))
    assert parsed is not None
    assert all("ownerReferences" not in o["metadata"] for o in build_children(parsed, "tok", "key", PEERS))


def test_runtime_ray_gets_no_rayjob():
    doc = set_path(set_path(valid_job("demo"), "runtime.kind", "Ray"), "runtime.address", "http://127.0.0.1:8265")
    # no engine key (its trainer makes its own) and no NetworkPolicy (the Ray cluster's pods are not kora's)
    assert [o["kind"] for o in build_children(job(doc), "tok", "key", PEERS)] == ["ConfigMap", "Secret"]


def test_secret_carries_the_given_token_and_tokens_are_random():
    s = build_secret(job(), "abc")
    assert s["stringData"] == {"token": "abc"} and s["type"] == "Opaque"
    assert s["metadata"]["name"] == secret_name("demo") == "demo-control-token"
    a, b = new_token(), new_token()
    assert a != b and len(a) >= 43 and re.fullmatch(r"[A-Za-z0-9_-]+", a)


def test_rayjob_lifecycle_fields_follow_the_spec():
    doc = valid_job("demo", suspend=True, backoffLimit=3, ttlSecondsAfterFinished=60, queueName="team-a-q")
    rj = build_ray_job(job(doc))
    assert rj["apiVersion"] == "ray.io/v1" and rj["kind"] == "RayJob"
    spec = rj["spec"]
    assert spec["entrypoint"] == ENTRYPOINT == "python -m kora_trainer.train --config /etc/kora/job.yaml"
    assert spec["suspend"] is True and spec["backoffLimit"] == 3
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] == 60
    assert rj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-q"
    assert mutable_spec(job(doc)) == {"suspend": True, "backoffLimit": 3, "ttlSecondsAfterFinished": 60}


def test_no_queue_label_without_queue_name():
    assert "kueue.x-k8s.io/queue-name" not in build_ray_job(job())["metadata"]["labels"]


def test_the_trainer_config_keeps_every_model_spec_field_and_drops_the_volume():
    doc = valid_job("demo")
    doc["spec"]["model"]["volume"] = {"persistentVolumeClaim": {"claimName": "models"}}
    spec = job(doc).spec
    model = spec.trainer_config().model
    assert type(model) is ModelSpec and set(ModelSpec.model_fields) <= set(type(spec.model).model_fields)
    assert model.model_dump() == spec.model.model_dump(include=set(ModelSpec.model_fields))
    rendered = yaml.safe_load(build_config_map(job(doc))["data"]["job.yaml"])["model"]
    assert set(rendered) == {f.alias or n for n, f in ModelSpec.model_fields.items()} and "volume" not in rendered


def test_head_and_workers_get_resources_volumes_and_ports():
    doc = valid_job("demo", resources={
        "workers": 2, "gpusPerWorker": 4, "cpu": "8", "memory": "64Gi", "shmSize": "8Gi",
        "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
    })
    doc["spec"]["model"]["volume"] = {"persistentVolumeClaim": {"claimName": "models"}, "mountPath": "/mnt/m"}
    rc = build_ray_job(job(doc))["spec"]["rayClusterSpec"]
    head = container(rc["headGroupSpec"]["template"])
    assert head["image"] == "ghcr.io/kora-dev/kora-trainer:0.1.0"
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert {"name": "kora-control", "containerPort": CONTROL_PORT, "protocol": "TCP"} in head["ports"]
    (group,) = rc["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2
    worker = container(group["template"])
    assert worker["resources"]["limits"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "4"}
    assert worker["resources"]["requests"] == worker["resources"]["limits"]
    assert group["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert group["template"]["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    for tmpl, component in ((rc["headGroupSpec"]["template"], "ray-head"), (group["template"], "ray-worker")):
        assert tmpl["metadata"]["labels"]["kora.dev/component"] == component
        vols = {v["name"]: v for v in tmpl["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in container(tmpl)["volumeMounts"] if "subPath" not in m}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"} and mounts["dshm"] == "/dev/shm"
        assert vols["trainer-config"]["configMap"]["name"] == "demo-trainer-config"
        assert mounts["trainer-config"] == "/etc/kora"
        assert vols["data"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": False}
        assert mounts["data"] == "/mnt/m"
        env = {e["name"]: e.get("value") for e in container(tmpl)["env"]}
        assert env["NCCL_DEBUG"] and env["NCCL_SOCKET_IFNAME"]
        # only the head (the driver, which serves :8068) sees the token
        assert ("control-token" in vols) == (component == "ray-head")
        assert ("KORA_CONTROL_TOKEN_FILE" in env) == (component == "ray-head")


def test_zero_workers_puts_the_gpus_on_the_head():
    doc = valid_job("demo", resources={"workers": 0, "gpusPerWorker": 2})
    rc = build_ray_job(job(doc))["spec"]["rayClusterSpec"]
    assert rc["workerGroupSpecs"] == []
    assert container(rc["headGroupSpec"]["template"])["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert rc["headGroupSpec"]["rayStartParams"]["num-gpus"] == "2"


def pods(rj):
    rc = rj["spec"]["rayClusterSpec"]
    return [("ray-head", rc["headGroupSpec"]), *(("ray-worker", g) for g in rc["workerGroupSpecs"])]


def pod_env(group):
    return {e["name"]: e.get("value") for e in container(group["template"])["env"]}


def test_the_worker_group_is_sized_from_resources_and_ray_counts_its_gpus():
    # the MoE recipe's shape: 8 trainer ranks + 2 engines x 4 GPUs, Disaggregated = 16 GPUs on 2 workers x 8
    doc = valid_job("moe", resources={"workers": 2, "gpusPerWorker": 8},
                    parallelism={"data": 4, "tensor": 2, "expert": 4},
                    rollout={"numEngines": 2, "gpusPerEngine": 4}, deployment={"mode": "Disaggregated"})
    (_, head), (_, group) = pods(build_ray_job(job(doc)))
    assert (group["groupName"], group["replicas"], group["minReplicas"], group["maxReplicas"]) == (
        "gpu-workers", 2, 2, 2)
    assert container(group["template"])["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert group["rayStartParams"] == {"num-gpus": "8"}  # strings: KubeRay's rayStartParams is map[string]string
    # the head runs the driver: no GPU in its pod, and Ray places no GPU actor on it
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in container(head["template"])["resources"]["limits"]


def test_every_ray_pod_gets_the_nccl_environment():
    for _, group in pods(build_ray_job(job())):
        env = pod_env(group)
        assert {k: env[k] for k in NCCL_ENV} == NCCL_ENV
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"  # the pod's interface
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_DEBUG"] == "WARN"
        # torch's default (3) tears a timed-out rank down without the abort that can hang
        assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env


def test_runtime_env_overrides_the_nccl_defaults_but_not_koras_own():
    doc = valid_job("ib", runtime={"env": {"NCCL_NVLS_ENABLE": "1", "NCCL_IB_HCA": "mlx5",
                                           "RAY_USAGE_STATS_ENABLED": "1", "KORA_CONTROL_PORT": "1"}})
    for component, group in pods(build_ray_job(job(doc))):
        env = pod_env(group)
        assert env["NCCL_NVLS_ENABLE"] == "1" and env["NCCL_IB_HCA"] == "mlx5" and env["NCCL_SOCKET_IFNAME"] == "eth0"
        assert env["RAY_USAGE_STATS_ENABLED"] == "0"  # spec.runtime.rayUsageStats decides that
        if component == "ray-head":
            assert env["KORA_CONTROL_PORT"] == str(CONTROL_PORT)
        names = [e["name"] for e in container(group["template"])["env"]]
        assert len(names) == len(set(names))


def test_runtime_env_names_must_be_environment_variable_names():
    _, problems = validate_job(valid_job("bad", runtime={"env": {"1X": "a", "A-B": "b", "OK_1": "c"}}))
    (p,) = problems
    assert p.field == "spec.runtime.env" and "1X, A-B" in p.message and "rename or remove" in p.message


def test_builders_are_pure():
    a, b = job(), job()
    assert build_children(a, "t", "k", PEERS) == build_children(b, "t", "k", PEERS)


@pytest.mark.parametrize("name", ["demo", "a" * 63, "1st-job", "my.job.v2", "x" * 253])
def test_rayjob_names_fit_kuberay(name):
    got = ray_job_name(name)
    assert len(got) <= MAX_RAYJOB_NAME
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", got), got
    assert got == ray_job_name(name)  # deterministic


def test_distinct_long_names_do_not_collide():
    assert ray_job_name("a" * 60 + "1") != ray_job_name("a" * 60 + "2")
    assert ray_job_name("my.job") != ray_job_name("my-job")


def test_ray_usage_stats_are_off_in_every_pod_unless_the_job_opts_in():
    def pod_envs(doc):
        rc = build_ray_job(job(doc))["spec"]["rayClusterSpec"]
        tmpls = [rc["headGroupSpec"]["template"], *(g["template"] for g in rc["workerGroupSpecs"])]
        return [{e["name"]: e.get("value") for e in container(t)["env"]} for t in tmpls]

    for env in pod_envs(valid_job("demo")):
        # no report, not even Ray's "disabled" notice (an empty URL fails before any socket is opened)
        assert env["RAY_USAGE_STATS_ENABLED"] == "0" and env["RAY_USAGE_STATS_REPORT_URL"] == ""
        assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env  # single-node only: pods form a multi-node cluster
    for env in pod_envs(valid_job("demo", runtime={"kind": "KubeRay", "rayUsageStats": True})):
        assert env["RAY_USAGE_STATS_ENABLED"] == "1" and "RAY_USAGE_STATS_REPORT_URL" not in env
