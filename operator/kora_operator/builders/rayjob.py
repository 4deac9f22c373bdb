"""The ray.io/v1 RayJob that runs the trainer: a head (driver + control-plane API) and GPU workers.

Field names follow KubeRay v1.5.0's CRD (apis/ray/v1/rayjob_types.go). One worker group of
resources.workers pods (a fixed size: min = max = replicas), each with resources.gpusPerWorker GPUs
and Ray's num-gpus saying so; the head has num-gpus 0 (it runs the driver, and Ray places no trainer
rank or engine on it), unless it is the only pod. The job was checked to fit those GPUs
(api/rules.py). Every pod mounts the trainer config, a memory-backed /dev/shm and the job's data
volume, and gets the NCCL environment multi-node needs (builders/ncclenv.py) and the engines' admin key
(a secretKeyRef to the job's engine-key Secret); only the head mounts the control-plane token.

Every pod, KubeRay's submitter included (`submitterPodTemplate`, so that it also carries the job's labels,
which the job's NetworkPolicy admits), runs locked down (POD_SECURITY, CONTAINER_SECURITY): not as root, no
capabilities, no privilege escalation, seccomp RuntimeDefault, a read-only root filesystem. What Ray, the
trainer and the engines write goes to emptyDirs (WRITABLE): /tmp (Ray's session directory /tmp/ray, torch's
and Triton's caches), HOME (~/.cache, ~/.triton, ~/.ray; Ray's bootstrap config mounted into it from the
ConfigMap, config/ray_env.py says why) and the image's working directory (the trainer's `.kora/runs/` run
directory); checkpoints go to the job's volume, which fsGroup makes writable for RUN_AS.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from kora_operator.api.job import EmptyDirSource, LoRATrainingJob, VolumeSpec
from kora_operator.builders.configmap import CONFIG_KEY, CONFIG_MOUNT_DIR
from kora_operator.builders.meta import COMPONENT_LABEL, JOB_LABEL, QUEUE_LABEL, labels, object_meta
from kora_operator.builders.names import config_map_name, engine_key_secret_name, ray_job_name, secret_name
from kora_operator.builders.ncclenv import nccl_env
from kora_operator.builders.secret import ENGINE_ADMIN_KEY_ENV, ENGINE_KEY_KEY, TOKEN_KEY
from kora_trainer.config.control import CONTROL_PORT, ControlEnv
from kora_trainer.config.ray_env import BOOTSTRAP_FILE, IMAGE_RAY_HOME, usage_stats_env

CONTROL_LINGER_S = 30
TOKEN_DIR = "/var/run/secrets/kora"
ENTRYPOINT = f"python -m kora_trainer.train --config {CONFIG_MOUNT_DIR}/{CONFIG_KEY}"
GPU = "nvidia.com/gpu"
WORKER_GROUP = "gpu-workers"
HEAD_PORTS = (("gcs-server", 6379), ("dashboard", 8265), ("client", 10001), ("kora-control", CONTROL_PORT))
SUBMITTER = "ray-job-submitter"  # KubeRay's name for the submitter container (utils.SubmitterContainerName)
# KubeRay's own default submitter resources (common/job.go GetDefaultSubmitterContainer, v1.5.0)
SUBMITTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "200Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
# A numeric non-root user: the trainer image (an SGLang base) declares none, and runAsNonRoot can only check a
# number. fsGroup gives it the emptyDirs and the job's volume (OnRootMismatch: no recursive chown of a volume
# of checkpoints that already has the group).
RUN_AS = 1000
POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
    "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
}
# The writable paths of a read-only root (see the module doc): volume name -> mount path
WORKDIR = "/workspace"  # the trainer image's WORKDIR (Dockerfile)
WRITABLE = {"tmp": "/tmp", "home": IMAGE_RAY_HOME, "workdir": WORKDIR}


def _env(job: LoRATrainingJob, head: bool) -> list[dict[str, Any]]:
    env = {
        "HOME": IMAGE_RAY_HOME,  # the emptyDir holding Ray's bootstrap config, whatever the image says
        **nccl_env(job, pod=True),  # kora's NCCL defaults under spec.runtime.env
        # Ray's usage report off unless the job opts in (runtime.rayUsageStats); the image's HOME holds the
        # cluster config that keeps Ray's dashboard from probing cloud metadata (config/ray_env.py)
        **usage_stats_env(job.spec.runtime.ray_usage_stats),
    }
    if head:  # the driver serves the control-plane API; only it needs the token
        env |= ControlEnv(
            port=CONTROL_PORT, token_file=f"{TOKEN_DIR}/{TOKEN_KEY}",
            host="0.0.0.0",  # the operator polls it through the head service (bearer token)
            linger_s=CONTROL_LINGER_S,  # after the last step, wait (at most this long) for the operator's read
        ).to_env()
    # the engines' admin key, from the job's Secret: the driver sends it (orchestration/cluster.py), the
    # engines on every pod demand it; the Secret is made before the RayJob
    key = {"secretKeyRef": {"name": engine_key_secret_name(str(job.metadata["name"])), "key": ENGINE_KEY_KEY}}
    return [{"name": k, "value": v} for k, v in env.items()] + [{"name": ENGINE_ADMIN_KEY_ENV, "valueFrom": key}]


def _writable() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The emptyDirs of a read-only root filesystem (volumes, mounts)."""
    return ([{"name": n, "emptyDir": {}} for n in WRITABLE],
            [{"name": n, "mountPath": path} for n, path in WRITABLE.items()])


def _data_volume(vol: VolumeSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": "data"}
    if vol.persistent_volume_claim is not None:
        pvc = vol.persistent_volume_claim
        out["persistentVolumeClaim"] = {"claimName": pvc.claim_name, "readOnly": pvc.read_only}
    elif vol.host_path is not None:
        out["hostPath"] = {"path": vol.host_path.path, "type": vol.host_path.type}
    else:
        src = vol.empty_dir or EmptyDirSource()
        out["emptyDir"] = src.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
    return out


def _volumes(job: LoRATrainingJob, head: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    name = str(job.metadata["name"])
    volumes: list[dict[str, Any]] = [
        {"name": "trainer-config", "configMap": {"name": config_map_name(name)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.spec.resources.shm_size}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "trainer-config", "mountPath": CONFIG_MOUNT_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    writable_volumes, writable_mounts = _writable()
    volumes += writable_volumes
    mounts += [*writable_mounts, {"name": "trainer-config", "mountPath": f"{IMAGE_RAY_HOME}/{BOOTSTRAP_FILE}",
                                  "subPath": BOOTSTRAP_FILE, "readOnly": True}]
    if head:
        volumes.append({"name": "control-token", "secret": {"secretName": secret_name(name), "defaultMode": 0o400}})
        mounts.append({"name": "control-token", "mountPath": TOKEN_DIR, "readOnly": True})
    vol = job.spec.model.volume
    if vol is not None:
        volumes.append(_data_volume(vol))
        mounts.append({"name": "data", "mountPath": vol.mount_path})
    return volumes, mounts


def _resources(cpu: str, memory: str, gpus: int) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts[GPU] = str(gpus)  # a quantity: the API server would hand it back as a string
    # requests == limits: Guaranteed QoS, and extended resources like GPUs require it anyway
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _pod(job: LoRATrainingJob, component: str, container: dict[str, Any], head: bool) -> dict[str, Any]:
    volumes, mounts = _volumes(job, head)
    res = job.spec.resources
    spec: dict[str, Any] = {
        "containers": [{
            "name": container["name"],  # first, as kubectl prints it; **container keeps the slot
            "image": job.spec.image,
            **container,
            "env": _env(job, head),
            "volumeMounts": mounts,
            "securityContext": deepcopy(CONTAINER_SECURITY),
        }],
        "volumes": volumes,
        "securityContext": deepcopy(POD_SECURITY),
    }
    if res.node_selector:
        spec["nodeSelector"] = dict(res.node_selector)
    if res.tolerations:
        spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in res.tolerations]
    return {"metadata": {"labels": labels(job, component)}, "spec": spec}


def _head(job: LoRATrainingJob) -> dict[str, Any]:
    res = job.spec.resources
    # with no worker pods the head is the whole cluster and takes the GPUs itself
    gpus = res.head_gpus
    container = {
        "name": "ray-head",
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in HEAD_PORTS],
        "resources": _resources(res.head_cpu, res.head_memory, gpus),
    }
    return {
        # num-gpus said, not left to KubeRay's reading of the container limits: Ray's GPUs are what the fit
        # rule counted (rayStartParams values are strings)
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": str(gpus)},
        "template": _pod(job, "ray-head", container, head=True),
    }


def _workers(job: LoRATrainingJob) -> list[dict[str, Any]]:
    res = job.spec.resources
    if res.workers == 0:
        return []
    container = {"name": "ray-worker", "resources": _resources(res.cpu, res.memory, res.gpus_per_worker)}
    return [{
        "groupName": WORKER_GROUP,
        "replicas": res.workers,
        "minReplicas": res.workers,
        "maxReplicas": res.workers,
        "rayStartParams": {"num-gpus": str(res.gpus_per_worker)},
        "template": _pod(job, "ray-worker", container, head=False),
    }]


def _submitter(job: LoRATrainingJob) -> dict[str, Any]:
    """KubeRay's submitter pod (`ray job submit` to the head's dashboard), as KubeRay would make it but with the
    job's labels and the locked-down security context; KubeRay fills in its command and environment. Like
    KubeRay's default it is placed anywhere (no node selector: it needs no GPU)."""
    volumes, mounts = _writable()
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{"name": SUBMITTER, "image": job.spec.image, "resources": deepcopy(SUBMITTER_RESOURCES),
                        "env": [{"name": "HOME", "value": IMAGE_RAY_HOME}], "volumeMounts": mounts,
                        "securityContext": deepcopy(CONTAINER_SECURITY)}],
        "volumes": volumes,
        "securityContext": deepcopy(POD_SECURITY),
    }
    return {"metadata": {"labels": labels(job, "ray-submitter")}, "spec": spec}


def mutable_spec(job: LoRATrainingJob) -> dict[str, Any]:
    """The RayJob spec fields that follow the LoRATrainingJob after creation (lifecycle fields)."""
    s = job.spec
    return {
        "suspend": s.suspend,
        "backoffLimit": s.backoff_limit,
        "ttlSecondsAfterFinished": s.ttl_seconds_after_finished,
    }


def build_ray_job(job: LoRATrainingJob) -> dict[str, Any]:
    extra = {QUEUE_LABEL: job.spec.queue_name} if job.spec.queue_name else {}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": object_meta(job, ray_job_name(str(job.metadata["name"])), "rayjob", **extra),
        "spec": {
            "entrypoint": ENTRYPOINT,
            # the Ray cluster goes away when the trainer ends (after the TTL, for logs); KubeRay
            # also requires it for suspend
            "shutdownAfterJobFinishes": True,
            **mutable_spec(job),
            "submitterPodTemplate": _submitter(job),
            "rayClusterSpec": {
                "headGroupSpec": _head(job),
                "workerGroupSpecs": _workers(job),
            },
        },
    }


__all__ = ["COMPONENT_LABEL", "CONTROL_PORT", "ENTRYPOINT", "JOB_LABEL", "build_ray_job", "mutable_spec"]
