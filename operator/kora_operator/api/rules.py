"""Rules only the operator needs (the trainer never sees resources or runtime)."""

from __future__ import annotations

from typing import Any

from kora_operator.api.job import LoRATrainingJobSpec, RuntimeKind
from kora_trainer.config.rules import Problem, SpecRule


def _gpus_needed(s: LoRATrainingJobSpec) -> int:
    engines = s.rollout.num_engines * s.rollout.gpus_per_engine
    actor = s.parallelism.actor_gpus
    return actor + engines if s.deployment.mode == "Disaggregated" else max(actor, engines)


def _violates_gpus(s: Any) -> bool:
    spec: LoRATrainingJobSpec = s
    have = spec.resources.workers * spec.resources.gpus_per_worker
    return spec.runtime.kind is RuntimeKind.KUBERAY and have > 0 and have < _gpus_needed(spec)


JOB_RULES: tuple[SpecRule, ...] = (
    SpecRule(
        "ray-runtime-address", "runtime.address",
        "runtime.kind Ray submits to an existing Ray cluster and needs runtime.address (its "
        "dashboard / Jobs API URL, e.g. http://ray-head:8265): set it, or use runtime.kind KubeRay",
        lambda s: s.runtime.kind is RuntimeKind.RAY and s.runtime.address is None,
        "self.runtime.kind != 'Ray' || has(self.runtime.address)",
    ),
    SpecRule(
        "not-enough-gpus", "resources.gpusPerWorker",
        "resources.workers x resources.gpusPerWorker is fewer GPUs than the job needs: the actor "
        "takes parallelism.data x tensor x pipeline x context GPUs and the engines "
        "rollout.numEngines x gpusPerEngine (added together when deployment.mode is "
        "Disaggregated, shared when Colocate): add workers or GPUs, or shrink the parallelism",
        _violates_gpus,
        "self.runtime.kind != 'KubeRay' || self.resources.workers * self.resources.gpusPerWorker == 0"
        " || self.resources.workers * self.resources.gpusPerWorker >= ("
        "self.deployment.mode == 'Disaggregated'"
        " ? self.parallelism.data * self.parallelism.tensor * self.parallelism.pipeline"
        " * self.parallelism.context + self.rollout.numEngines * self.rollout.gpusPerEngine"
        " : (self.parallelism.data * self.parallelism.tensor * self.parallelism.pipeline"
        " * self.parallelism.context >= self.rollout.numEngines * self.rollout.gpusPerEngine"
        " ? self.parallelism.data * self.parallelism.tensor * self.parallelism.pipeline"
        " * self.parallelism.context : self.rollout.numEngines * self.rollout.gpusPerEngine))",
    ),
)


def job_problems(spec: LoRATrainingJobSpec) -> list[Problem]:
    return [Problem(r.id, r.field, r.message) for r in JOB_RULES if r.violated(spec)]
