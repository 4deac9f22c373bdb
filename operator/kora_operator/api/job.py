"""LoRATrainingJob: the trainer's config sections plus what Kubernetes needs to run them."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from kora_operator.api.status import LoRATrainingJobStatus
from kora_trainer.config.base import CamelModel
from kora_trainer.config.sections import ModelSpec
from kora_trainer.config.trainer import TrainerConfig

GROUP = "kora.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


class PVCSource(CamelModel):
    """A PersistentVolumeClaim in the job's namespace."""

    claim_name: Annotated[str, Field(min_length=1)]
    """Name of the claim."""
    read_only: bool = False
    """Mount read-only (checkpoints then need another path)."""


class HostPathSource(CamelModel):
    """A directory on the node (single-node clusters and tests)."""

    path: Annotated[str, Field(min_length=1)]
    """Directory on the host."""
    type: Literal["", "Directory", "DirectoryOrCreate"] = "Directory"
    """Directory (must exist) or DirectoryOrCreate."""


class EmptyDirSource(CamelModel):
    """Scratch space that lives as long as the pod."""

    medium: Literal["", "Memory"] = ""
    """"" for node disk, Memory for tmpfs."""
    size_limit: Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")] | None = None
    """Size limit, e.g. 10Gi."""


class VolumeSpec(CamelModel):
    """The volume holding the model, the data and the checkpoints. Set exactly one source."""

    model_config = CamelModel.model_config | {
        "json_schema_extra": {"x-kubernetes-validations": [{
            "rule": "[has(self.persistentVolumeClaim), has(self.hostPath), has(self.emptyDir)]"
                    ".filter(x, x).size() == 1",
            "message": "model.volume needs exactly one of persistentVolumeClaim, hostPath or emptyDir",
        }]}
    }

    mount_path: Annotated[str, Field(pattern=r"^/")] = "/mnt/kora"
    """Where the volume is mounted in every Ray pod; model.path, data.path and checkpoint.path
    are paths under it."""
    persistent_volume_claim: PVCSource | None = None
    """Use a PersistentVolumeClaim."""
    host_path: HostPathSource | None = None
    """Use a host directory."""
    empty_dir: EmptyDirSource | None = None
    """Use an emptyDir (data must be fetched by the job itself)."""


class ModelVolumeSpec(ModelSpec):
    """The base model and the volume it lives on."""

    volume: VolumeSpec | None = None
    """Volume mounted into every Ray pod. Unset for runtime Ray, where paths are the Ray
    cluster's own."""


class Toleration(CamelModel):
    """A core/v1 Toleration."""

    key: str | None = None
    """Taint key; empty with operator Exists matches every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Exists or Equal."""
    value: str | None = None
    """Taint value for Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to tolerate; empty means all."""
    toleration_seconds: int | None = None
    """NoExecute only: how long to stay bound after the taint appears."""


ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"  # a name a POSIX shell can export
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"


class ResourcesSpec(CamelModel):
    """Ray pods: how many workers, what each gets, and where they may run.

    For runtime KubeRay the job must fit the Ray cluster these make (checked at kubectl apply and by `kora
    validate`): the trainer ranks (parallelism data x tensor x pipeline x context, one GPU each) and the engines
    (rollout.numEngines x gpusPerEngine: beside the ranks when deployment.mode is Disaggregated, sharing their GPUs
    when Colocate) need at most workers x gpusPerWorker GPUs, and a tensor-parallel group or one engine must fit
    on one worker. gpusPerWorker 0 makes a CPU cluster: only the reference engine (rollout.engine hf,
    gpusPerEngine 0) runs there. For runtime Ray these fields are not used: the existing cluster's GPUs cannot
    be seen at apply time, and the trainer refuses to start when its Ray cluster has too few."""

    workers: Annotated[int, Field(ge=0, le=1024)] = 1
    """Ray worker pods, each with gpusPerWorker GPUs; the head runs the driver and the control-plane API and
    has no GPU. 0: no workers, the head pod is the whole Ray cluster and takes the gpusPerWorker GPUs itself."""
    gpus_per_worker: Annotated[int, Field(ge=0, le=16)] = 8
    """nvidia.com/gpu per worker pod (and Ray's num-gpus on it)."""
    cpu: Annotated[str, Field(pattern=_QUANTITY)] = "16"
    """CPU request/limit per worker pod."""
    memory: Annotated[str, Field(pattern=_QUANTITY)] = "128Gi"
    """Memory request/limit per worker pod."""
    head_cpu: Annotated[str, Field(pattern=_QUANTITY)] = "4"
    """CPU for the head pod."""
    head_memory: Annotated[str, Field(pattern=_QUANTITY)] = "16Gi"
    """Memory for the head pod."""
    shm_size: Annotated[str, Field(pattern=_QUANTITY)] = "16Gi"
    """Size of the memory-backed /dev/shm in each pod (NCCL and IPC need it)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the worker pods must match."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the worker pods tolerate (e.g. nvidia.com/gpu)."""

    @property
    def head_gpus(self) -> int:
        """GPUs of the head pod: none, unless it is the only pod (workers 0)."""
        return self.gpus_per_worker if self.workers == 0 else 0

    def gpus_per_node(self) -> list[int]:
        """The GPUs of each Ray node that holds GPUs (the workers, or the lone head), as layout's
        total_gpus_problem / node_gpus_problem take them."""
        return [self.gpus_per_worker] * max(self.workers, 1)


class RuntimeKind(StrEnum):
    KUBERAY = "KubeRay"
    RAY = "Ray"


class RuntimeSpec(CamelModel):
    """Where the trainer runs."""

    kind: RuntimeKind = RuntimeKind.KUBERAY
    """KubeRay: a RayJob (its own Ray cluster) per LoRATrainingJob. Ray: submit to an existing
    Ray cluster through its Jobs API at address."""
    address: Annotated[str, Field(pattern=r"^https?://")] | None = None
    """Ray dashboard / Jobs API address for kind Ray, e.g. http://127.0.0.1:8265. Whether the job fits that
    cluster's GPUs is not known at apply time: the trainer checks it when it starts and fails with the numbers
    (resources does not apply to kind Ray)."""
    ray_usage_stats: bool = False
    """Let Ray send its anonymous usage statistics to the Ray project (RAY_USAGE_STATS_ENABLED=1). Off by
    default: kora's Ray pods and submissions run with RAY_USAGE_STATS_ENABLED=0 and no report URL, and the
    trainer image's HOME holds a Ray cluster config, so Ray neither reports nor probes cloud metadata
    servers. For kind Ray this covers the job's own processes only; the existing cluster's head follows
    its own settings."""
    env: Annotated[dict[str, str], Field(max_length=64)] = Field(default_factory=dict)
    """Environment variables for every Ray process of the job (kind KubeRay: the head and worker pods; kind Ray:
    the submission's runtime_env). They override kora's NCCL defaults (NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME
    eth0 in the pods, NCCL_NVLS_ENABLE 0, NCCL_DEBUG WARN), e.g. NCCL_NVLS_ENABLE=1 on an NVSwitch system whose
    fabric manager provides NVLink SHARP, or NCCL_IB_HCA for an InfiniBand fabric. kora's own variables (KORA_*,
    and RAY_USAGE_STATS_* from rayUsageStats) are set after these and win."""

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in env if not re.fullmatch(ENV_NAME, k))
        if bad:
            raise ValueError(f"{', '.join(bad)}: not an environment variable name (letters, digits and _, not "
                             "starting with a digit): rename or remove it")
        return env


# Spec fields that may change on a created job. The lifecycle fields, which the operator passes on
# (the RayJob's suspend/backoffLimit/ttlSecondsAfterFinished; for runtime Ray a stop or a resubmission);
# and spec.checkpoint, which has always been left mutable (kept so here: no behaviour changes with the
# derivation below).
LIFECYCLE_FIELDS = frozenset({"suspend", "backoff_limit", "ttl_seconds_after_finished"})
MUTABLE_FIELDS = LIFECYCLE_FIELDS | {"checkpoint"}


def immutable_sections(spec: type[BaseModel]) -> tuple[str, ...]:
    """The fields of `spec` that cannot change on a created job, as the CRD spells them: everything but
    MUTABLE_FIELDS. They define what is being trained, or the Ray cluster it runs on (the RayJob's
    rayClusterSpec is fixed once created), so a new section is immutable unless it is said otherwise."""
    return tuple(f.alias or name for name, f in spec.model_fields.items() if name not in MUTABLE_FIELDS)


class LoRATrainingJobSpec(TrainerConfig):
    """Desired state: the trainer config plus image, resources, lifecycle and runtime."""

    model: ModelVolumeSpec
    """The base model (frozen) and the volume holding it, the data and the checkpoints."""
    image: Annotated[str, Field(min_length=1)] = "ghcr.io/kora-dev/kora-trainer:0.1.0"
    """Trainer image for the Ray head and workers."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """Ray worker count, GPUs, CPU/memory, node selector and tolerations."""
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    """KubeRay (a RayJob per job) or Ray (an existing Ray cluster)."""
    suspend: bool = False
    """Suspend the job: the Ray cluster is torn down; resuming continues from the last checkpoint."""
    backoff_limit: Annotated[int, Field(ge=0, le=100)] = 0
    """Retries after a trainer failure; each retry resumes from the last LoRA-only checkpoint."""
    ttl_seconds_after_finished: Annotated[int, Field(ge=0)] = 600
    """Seconds the finished Ray cluster is kept (for logs) before it is deleted."""
    queue_name: Annotated[str, Field(max_length=63)] | None = None
    """Kueue LocalQueue; passed as the kueue.x-k8s.io/queue-name label on the RayJob."""

    def trainer_config(self) -> TrainerConfig:
        """The part the trainer reads (rendered into the job's ConfigMap): the trainer's sections, and of
        the model section every ModelSpec field (the volume is the pods' business, not the trainer's)."""
        keep: dict[str, Any] = dict.fromkeys(TrainerConfig.model_fields, True)
        keep["model"] = set(ModelSpec.model_fields)
        return TrainerConfig.model_validate(self.model_dump(by_alias=True, mode="json", include=keep))


IMMUTABLE_SECTIONS = immutable_sections(LoRATrainingJobSpec)


class LoRATrainingJob(CamelModel):
    """A LoRA reinforcement-learning post-training job, run on Ray (KubeRay or an existing cluster)."""

    api_version: Literal["kora.dev/v1alpha1"] = "kora.dev/v1alpha1"
    """kora.dev/v1alpha1"""
    kind: Literal["LoRATrainingJob"] = "LoRATrainingJob"
    """LoRATrainingJob"""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Standard object metadata."""
    spec: LoRATrainingJobSpec
    """Desired state."""
    status: LoRATrainingJobStatus | None = None
    """Observed state, written by the operator."""
