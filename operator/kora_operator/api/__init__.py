"""The kora.dev/v1alpha1 API: pydantic models that are the single source of the CRDs."""

from kora_operator.api.job import (
    API_VERSION,
    GROUP,
    VERSION,
    LoRATrainingJob,
    LoRATrainingJobSpec,
    ResourcesSpec,
    RuntimeKind,
    RuntimeSpec,
    VolumeSpec,
)
from kora_operator.api.status import Condition, LoRATrainingJobStatus, Phase

__all__ = [
    "API_VERSION", "GROUP", "VERSION", "Condition", "LoRATrainingJob", "LoRATrainingJobSpec",
    "LoRATrainingJobStatus", "Phase", "ResourcesSpec", "RuntimeKind", "RuntimeSpec", "VolumeSpec",
]
