"""Rules only the operator needs (the trainer never sees resources or runtime).

The fit of a KubeRay job: the GPU arithmetic is config/layout.py's (`gpu_demand`, `total_gpus_problem`,
`node_gpus_problem`), over the nodes ResourcesSpec makes (`gpus_per_node`). The CEL below says the same in the
API server, field by field, with layout's message templates: tests/integration/test_crd_apiserver.py checks that
the API server and `kora validate` refuse the same specs with the same words. For runtime Ray the existing
cluster's GPUs are unknown at apply time: the trainer refuses to start there when they are too few.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kora_operator.api.job import LoRATrainingJobSpec, RuntimeKind
from kora_trainer.config.layout import (
    COLOCATE_TOTAL,
    DISAGGREGATED_TOTAL,
    NODE_GPUS_MESSAGE,
    TOTAL_GPUS_MESSAGE,
    engine_gpus,
    node_gpus_problem,
    total_gpus_problem,
)
from kora_trainer.config.load import ConfigError
from kora_trainer.config.placement import Node, build_node_problem, plan_job
from kora_trainer.config.rules import Problem, SpecRule, cel_format
from kora_trainer.config.sections import Engine

# layout.py's arithmetic in CEL. Every field read here has a default in the CRD (and its section defaults to
# {}), so after defaulting each is present and no has() is needed.
_R = "self.rollout"
_P = "self.parallelism"
_ENGINE_GPUS = f"({_R}.engine == 'sglang' || {_R}.gpusPerEngine < 1 ? {_R}.gpusPerEngine : 1)"  # engine_gpus
_COLOCATED = f"(self.deployment.mode == 'Colocate' && {_R}.distributedEngines == 0)"  # colocated
_RANKS = f"({_P}.data * {_P}.tensor * {_P}.pipeline * {_P}.context)"  # world_size
_ENGINES = f"({_R}.numEngines * {_ENGINE_GPUS})"
_TOTAL = f"({_COLOCATED} ? ({_RANKS} >= {_ENGINE_GPUS} ? {_RANKS} : {_ENGINE_GPUS}) : {_RANKS} + {_ENGINES})"  # .total
_LARGEST = f"({_P}.tensor >= {_ENGINE_GPUS} ? {_P}.tensor : {_ENGINE_GPUS})"  # gpu_demand().largest_group
_NODES = "(self.resources.workers == 0 ? 1 : self.resources.workers)"  # len(ResourcesSpec.gpus_per_node())
_HAVE = f"({_NODES} * self.resources.gpusPerWorker)"  # sum(ResourcesSpec.gpus_per_node())
_GPU_KUBERAY = "(self.runtime.kind == 'KubeRay' && self.resources.gpusPerWorker > 0)"


def _gpu_nodes(s: Any) -> list[int] | None:
    """The GPUs of each node of the Ray cluster the RayJob makes; None where no fit is checked here (runtime
    Ray, or a CPU cluster: the next rule)."""
    spec: LoRATrainingJobSpec = s
    if spec.runtime.kind is not RuntimeKind.KUBERAY or spec.resources.gpus_per_worker == 0:
        return None
    return spec.resources.gpus_per_node()


def _on_gpu_nodes(check: Callable[[Any, list[int]], str | None]) -> Callable[[Any], str | None]:
    """A layout check (a message, None: it fits) asked about the KubeRay cluster's GPU nodes."""
    def problem(s: Any) -> str | None:
        nodes = _gpu_nodes(s)
        return None if nodes is None else check(s, nodes)
    return problem


def _fit_rule(id_: str, field: str, message: str, problem: Callable[[Any], str | None], cel: str,
              template: str, cel_args: list[str]) -> SpecRule:
    """A rule decided and worded by `problem`; its CEL renders layout's `template` with `cel_args`."""
    return SpecRule(id_, field, message, lambda s: problem(s) is not None, cel,
                    explain=lambda s: problem(s) or message, cel_message=cel_format(template, cel_args))


def _cpu_cluster_needs_gpus(s: Any) -> bool:
    spec: LoRATrainingJobSpec = s
    return (spec.runtime.kind is RuntimeKind.KUBERAY and spec.resources.gpus_per_worker == 0
            and (spec.rollout.engine is Engine.SGLANG or engine_gpus(spec) > 0))


JOB_RULES: tuple[SpecRule, ...] = (
    SpecRule(
        "ray-runtime-address", "runtime.address",
        "runtime.kind Ray submits to an existing Ray cluster and needs runtime.address (its "
        "dashboard / Jobs API URL, e.g. http://ray-head:8265): set it, or use runtime.kind KubeRay",
        lambda s: s.runtime.kind is RuntimeKind.RAY and s.runtime.address is None,
        "self.runtime.kind != 'Ray' || has(self.runtime.address)",
    ),
    _fit_rule(
        "kuberay-gpus", "resources.workers",
        "resources.workers x resources.gpusPerWorker is fewer GPUs than the job needs (the trainer ranks, "
        "parallelism data x tensor x pipeline x context, and the engines, rollout.numEngines x gpusPerEngine: "
        "added together when Disaggregated, shared when Colocate): raise resources.workers or "
        "resources.gpusPerWorker, or lower parallelism / rollout.numEngines",
        _on_gpu_nodes(total_gpus_problem), f"!{_GPU_KUBERAY} || {_TOTAL} <= {_HAVE}",
        TOTAL_GPUS_MESSAGE, [
            _TOTAL, _RANKS, f"{_R}.numEngines", _ENGINE_GPUS,
            f"{_COLOCATED} ? {json.dumps(COLOCATE_TOTAL)} : {json.dumps(DISAGGREGATED_TOTAL)}", _HAVE, _NODES,
            f"{_NODES} == 1 ? 'node' : 'nodes'"],
    ),
    _fit_rule(
        "kuberay-gpus-per-node", "resources.gpusPerWorker",
        "parallelism.tensor and rollout.gpusPerEngine must each fit on one Ray worker: raise "
        "resources.gpusPerWorker to the larger of them, or lower them",
        _on_gpu_nodes(node_gpus_problem), f"!{_GPU_KUBERAY} || {_LARGEST} <= self.resources.gpusPerWorker",
        NODE_GPUS_MESSAGE, [f"{_P}.tensor", _ENGINE_GPUS, "self.resources.gpusPerWorker", _LARGEST],
    ),
    SpecRule(
        "kuberay-cpu-engines", "rollout.engine",
        "resources.gpusPerWorker 0 makes a Ray cluster without GPUs, where only kora's reference engine runs, on "
        "CPU: set rollout.engine hf and rollout.gpusPerEngine 0, or give the Ray pods GPUs with "
        "resources.gpusPerWorker",
        _cpu_cluster_needs_gpus,
        f"self.runtime.kind != 'KubeRay' || self.resources.gpusPerWorker > 0 || ({_R}.engine == 'hf' && "
        f"{_R}.gpusPerEngine == 0)",
    ),
)


def build_node_problems(spec: LoRATrainingJobSpec) -> list[Problem]:
    """The stock SGLang build hands a Disaggregated adapter over in memory: on a KubeRay cluster whose placement
    puts an engine on another worker than trainer rank 0 the job is refused (no CEL: the placement is
    config/placement.py's, not arithmetic the API server can follow), as `kora plan` and the trainer refuse it."""
    nodes = _gpu_nodes(spec)
    if nodes is None:
        return []
    try:
        plan = plan_job(spec, [Node(f"worker-{i}", 64.0, g) for i, g in enumerate(nodes)], check_build=False)
    except ConfigError:  # a layout the fit rules above refuse already
        return []
    away = build_node_problem(spec, plan)
    return [Problem("build-adapter-one-node", "rollout.sglangBuild", away)] if away else []


def job_problems(spec: LoRATrainingJobSpec) -> list[Problem]:
    return [r.problem(spec) for r in JOB_RULES if r.violated(spec)] + build_node_problems(spec)
