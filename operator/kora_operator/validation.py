"""Validate a LoRATrainingJob / LoRAAdapter document: schema, then every rule, as Problems.

Used by `kora validate` and by the operator (a spec that slips past the CRD — e.g. a rule that
needs the model's config.json — ends as phase Failed, reason ValidationFailed, same message).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kora_operator.api.adapter import LoRAAdapter
from kora_operator.api.job import LoRATrainingJob
from kora_operator.api.rules import job_problems
from kora_trainer.config.load import format_validation_error, read_hf_config
from kora_trainer.config.rules import (
    Problem,
    adapter_problems,
    model_problems,
    spec_problems,
    start_adapter_problems,
)


def _schema_problems(err: ValidationError) -> list[Problem]:
    return [Problem("schema", line.split(":", 1)[0], line) for line in format_validation_error(err)]


def validate_job(
    doc: Mapping[str, Any], hf_config: Mapping[str, Any] | None = None
) -> tuple[LoRATrainingJob | None, list[Problem]]:
    """Parse and check one LoRATrainingJob, its multiLora.adapters too. config.json rules run when model.path is
    readable here (or `hf_config` is given)."""
    try:
        job = LoRATrainingJob.model_validate(doc)
    except ValidationError as e:
        return None, _schema_problems(e)
    spec = job.spec
    if hf_config is None:
        hf_config = read_hf_config(spec.model.path)
    problems = spec_problems(spec) + job_problems(spec) + start_adapter_problems(spec)
    return job, problems + model_problems(spec, hf_config)


def validate_adapter(
    doc: Mapping[str, Any], job: LoRATrainingJob | None
) -> tuple[LoRAAdapter | None, list[Problem]]:
    """Parse one LoRAAdapter; with its job known, apply SPEC rule 9."""
    try:
        adapter = LoRAAdapter.model_validate(doc)
    except ValidationError as e:
        return None, _schema_problems(e)
    if job is None:
        return adapter, []
    a, algo = adapter.spec, job.spec.algorithm
    problems = []
    if not job.spec.multi_lora.on:
        problems.append(Problem("adapter-needs-multi-lora", "spec.jobName",
            f"LoRAAdapter {adapter.metadata.get('name')}: LoRATrainingJob {a.job_name} has "
            f"multiLora.maxAdapters 0 and serves no adapters: set its multiLora.maxAdapters > 0"))
    name = str(adapter.metadata.get("name"))
    if name in {started.name for started in job.spec.multi_lora.adapters}:
        problems.append(Problem("adapter-name-taken", "metadata.name",
            f"LoRAAdapter {name}: LoRATrainingJob {a.job_name} trains an adapter of that name from the start "
            f"(multiLora.adapters): give the LoRAAdapter another name"))
    problems += adapter_problems(
        job.spec, name=name, rank=a.rank,
        rollout_batch_size=a.rollout_batch_size or algo.rollout_batch_size,
        n_samples_per_prompt=a.n_samples_per_prompt or algo.n_samples_per_prompt,
        stream_groups=a.stream_groups,
        config=a,
    )
    return adapter, problems
