"""Malformed LoRATrainingJobs and LoRAAdapters, generated from the CRDs' own schemas (which the pydantic models
generate: api/crd.py), for the operator chaos run (bench/chaos_operator.py, tests/integration/test_chaos_operator.py).

Each malformation breaks one thing the schema states — a wrong type, a number past its minimum or maximum, a string
outside its enum or past its length, a required field left out — or one CEL rule (specs.VIOLATIONS). Every one
of them must be refused: at apply by the API server (422), or by the operator's validation (Failed,
ValidationFailed). `field` is the dotted path the refusal must name.

`operator_only` makes the rest: objects the CRD accepts whole and only the operator's own validation refuses
(config/rules.py's rules with no CEL: the ones that read the model's config.json, the adapters a job starts
with, a LoRAAdapter against its job, the placement of a stock-build adapter, language fields in a diffusion
job). Each of those must pass `kubectl apply` and then go Failed/ValidationFailed naming `field`.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kora_trainer.config.rules import LANGUAGE_ONLY
from kora_trainer.config.trainer import TrainerConfig
from specs import DIFFUSION, VIOLATIONS, set_path, valid_job

ROOT = Path(__file__).resolve().parents[1]
DELETE = object()  # the value that means "leave the field out"
WRONG_TYPE: dict[str, Any] = {"integer": "not-a-number", "number": "not-a-number", "string": 12345,
                              "boolean": "maybe", "object": "not-an-object", "array": "not-a-list"}


@dataclass(frozen=True)
class Malformed:
    kind: str  # LoRATrainingJob | LoRAAdapter
    field: str  # dotted under spec, e.g. lora.rank
    # wrong-type, below-minimum, above-maximum, not-in-enum, too-long, empty, missing-required, rule:<CEL rule id>,
    # operator:<rules.py rule id> (accepted at apply, refused by the operator)
    how: str
    changes: tuple[tuple[str, Any], ...]  # (dotted path, value or DELETE)
    name: str | None = None  # the object's name when the rule is about it (else the caller names it)

    @property
    def operator_only(self) -> bool:
        return self.how.startswith("operator:")

    def doc(self, name: str) -> dict[str, Any]:
        name = self.name or name
        base = valid_job(name) if self.kind == "LoRATrainingJob" else valid_adapter(name)
        for path, value in self.changes:
            base = _delete(base, path) if value is DELETE else set_path(base, path, value)
        return base


def valid_adapter(name: str, job: str = "no-such-job") -> dict[str, Any]:
    return {"apiVersion": "kora.dev/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": name},
            "spec": {"jobName": job, "rank": 8, "numSteps": 10, "data": {"path": "/nonexistent/data.parquet"}}}


def _delete(doc: dict[str, Any], dotted: str) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node = doc["spec"]
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node.pop(last, None)
    return doc


def _spec_schema(crd_file: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "manifests/crds" / crd_file).read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])


def _fields(schema: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any], bool]]:
    """(dotted path, its schema, required) for every property, objects recursed into (arrays are not)."""
    required = set(schema.get("required") or ())
    for key, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}{key}"
        yield path, sub, key in required
        if sub.get("type") == "object" and sub.get("properties"):
            yield from _fields(sub, path + ".")


def _breaks(path: str, sub: dict[str, Any], required: bool) -> Iterator[tuple[str, Any]]:
    if sub.get("x-kubernetes-int-or-string") or sub.get("x-kubernetes-preserve-unknown-fields"):
        return
    if sub.get("type") in WRONG_TYPE:
        yield "wrong-type", WRONG_TYPE[sub["type"]]
    if "minimum" in sub:
        yield "below-minimum", sub["minimum"] - 1
    if "maximum" in sub:
        yield "above-maximum", sub["maximum"] + 1
    if sub.get("enum"):
        yield "not-in-enum", "NotOneOfThem"
    if sub.get("maxLength"):
        yield "too-long", "x" * (int(sub["maxLength"]) + 1)
    if sub.get("minLength"):
        yield "empty", ""
    if required:
        yield "missing-required", DELETE


def all_malformed() -> list[Malformed]:
    """Every single-fault malformation of both kinds, in a fixed order."""
    out: list[Malformed] = []
    kinds = (("LoRATrainingJob", "kora.dev_loratrainingjobs.yaml"), ("LoRAAdapter", "kora.dev_loraadapters.yaml"))
    for kind, crd in kinds:
        for path, sub, required in _fields(_spec_schema(crd)):
            for how, value in _breaks(path, sub, required):
                out.append(Malformed(kind, path, how, ((path, value),)))
    for rule, changes in VIOLATIONS.items():
        # the rule's message names its first field (rules.py: each Problem's field)
        out.append(Malformed("LoRATrainingJob", next(iter(changes)), f"rule:{rule}", tuple(changes.items())))
    return out


def sample(n: int, seed: int, model_dir: Path | None = None) -> list[Malformed]:
    """n malformations, seeded: the whole list shuffled, again and again until n (so each appears about as often);
    with `model_dir`, every operator-only one as well (once each, see operator_only), shuffled in among them."""
    rng = random.Random(seed)
    pool = all_malformed()
    out: list[Malformed] = []
    while len(out) < n:
        batch = list(pool)
        rng.shuffle(batch)
        out += batch[: n - len(out)]
    if model_dir is not None:
        out += operator_only(model_dir)
        rng.shuffle(out)
    return out


# -- past the CRD: what only the operator's own validation refuses ------------------------------------------------

# the jobs the operator-only LoRAAdapters name (valid: the operator gives them their children): one without slots,
# one multi-adapter job on the build that has them, on 4 data-parallel ranks, training adapter TAKEN from its start
TARGET_SINGLE, TARGET_MULTI, TAKEN = "fuzz-target-single", "fuzz-target-multi", "fuzz-taken"
_MULTI = {"lora.syncMode": "Adapter", "rollout.sglangBuild": "sglang-miles-94949da7", "multiLora.maxAdapters": 2}


def _start_adapter(name: str = "a", **fields: Any) -> dict[str, Any]:
    return {"name": name, "rank": 8, "data": {"path": "/nonexistent/a.parquet"}, **fields}


def targets() -> list[dict[str, Any]]:
    """The valid jobs `operator_only`'s LoRAAdapters are checked against: create them first."""
    multi = valid_job(TARGET_MULTI)
    for path, value in {**_MULTI, "parallelism.data": 4, "multiLora.adapters": [_start_adapter(TAKEN)]}.items():
        multi = set_path(multi, path, value)
    return [valid_job(TARGET_SINGLE), multi]


def _other(sub: dict[str, Any]) -> Any:
    """A value the CRD accepts for this field that is not its default."""
    default = sub["default"]
    if sub.get("type") == "array":
        return default[:1]
    if sub.get("enum"):
        return next(e for e in sub["enum"] if e not in (default, "custom"))  # custom needs its path (CEL)
    return default + 1 if sub.get("type") == "integer" else default / 2


def _diffusion_unused() -> Iterator[Malformed]:
    """rules.diffusion_unused_problems: each language-model field a diffusion job never reads, set off its
    default (generated from that rule's own table and the CRD's defaults)."""
    schema = _spec_schema("kora.dev_loratrainingjobs.yaml")["properties"]
    for section, name, _ in LANGUAGE_ONLY:
        info = TrainerConfig.model_fields[section].annotation.model_fields[name]  # type: ignore[union-attr]
        path = f"{section}.{info.alias or name}"
        value = _other(schema[section]["properties"][info.alias or name])
        yield Malformed("LoRATrainingJob", path, "operator:diffusion-unused", (*DIFFUSION.items(), (path, value)))


def operator_only(model_dir: Path) -> list[Malformed]:
    """Every operator-only refusal, once each, in a fixed order. Writes the config.json files the model rules
    read under `model_dir` (which the operator must be able to read: it runs on this machine)."""
    (model_dir / "vl").mkdir(parents=True, exist_ok=True)
    (model_dir / "vl/config.json").write_text('{"vision_config": {"depth": 2}}')
    (model_dir / "moe").mkdir(parents=True, exist_ok=True)
    (model_dir / "moe/config.json").write_text('{"num_experts": 8}')
    a = _start_adapter
    jobs: list[tuple[str, str, dict[str, Any]]] = [
        # SPEC rule 4, from config.json
        ("adapter-vision-scope", "lora.scope", {"model.path": str(model_dir / "vl"), "lora.syncMode": "Adapter"}),
        # SPEC rule 6: expert parallelism says MoE; or config.json does
        ("moe-expert-tensor", "parallelism.expertTensor",
         {"parallelism.expert": 2, "parallelism.expertTensor": 2, "parallelism.data": 4,
          "lora.targetModules": ["linear_fc1"]}),
        ("moe-expert-tensor", "parallelism.expertTensor",
         {"model.path": str(model_dir / "moe"), "parallelism.expertTensor": 2, "parallelism.data": 2,
          "lora.targetModules": ["linear_fc2"]}),
        # the stock build's in-memory adapter hand-over with the engine on another worker (config/placement.py)
        ("build-adapter-one-node", "rollout.sglangBuild",
         {"lora.syncMode": "Adapter", "deployment.mode": "Disaggregated", "resources.workers": 2,
          "resources.gpusPerWorker": 1, "rollout.gpusPerEngine": 1}),
        # the adapters a job starts with (start_adapter_problems, SPEC rule 9 for each)
        ("start-adapters-need-slots", "multiLora.maxAdapters", {"multiLora.adapters": [a()]}),
        ("start-adapters-fit", "multiLora.maxAdapters",
         {**_MULTI, "multiLora.maxAdapters": 1, "multiLora.adapters": [a("a"), a("b")]}),
        ("start-adapter-names", "multiLora.adapters", {**_MULTI, "multiLora.adapters": [a("a"), a("a")]}),
        ("adapter-rank", "multiLora.adapters[0].rank", {**_MULTI, "multiLora.adapters": [a(rank=16)]}),
        ("adapter-samples-dp", "multiLora.adapters[0].nSamplesPerPrompt",
         {**_MULTI, "parallelism.data": 4, "multiLora.adapters": [a(nSamplesPerPrompt=3)]}),
        ("adapter-batch-groups", "multiLora.adapters[0].rolloutBatchSize",
         {**_MULTI, "parallelism.data": 4, "multiLora.adapters": [a(nSamplesPerPrompt=2, rolloutBatchSize=3)]}),
        ("adapter-batch-cap", "multiLora.adapters[0].rolloutBatchSize",
         {**_MULTI, "multiLora.adapters": [a(rolloutBatchSize=1024)]}),
    ]
    out = [Malformed("LoRATrainingJob", f, f"operator:{rule}", tuple(ch.items())) for rule, f, ch in jobs]
    out += _diffusion_unused()
    # a LoRAAdapter against its (valid) job: validation.validate_adapter, SPEC rule 9
    adapters: list[tuple[str, str, dict[str, Any], str | None]] = [
        ("adapter-needs-multi-lora", "spec.jobName", {"jobName": TARGET_SINGLE}, None),
        ("adapter-name-taken", "metadata.name", {"jobName": TARGET_MULTI}, TAKEN),
        ("adapter-rank", "spec.rank", {"jobName": TARGET_MULTI, "rank": 16}, None),
        ("adapter-samples-dp", "spec.nSamplesPerPrompt", {"jobName": TARGET_MULTI, "nSamplesPerPrompt": 3}, None),
        ("adapter-batch-groups", "spec.rolloutBatchSize",
         {"jobName": TARGET_MULTI, "nSamplesPerPrompt": 2, "rolloutBatchSize": 3}, None),
        ("adapter-batch-cap", "spec.rolloutBatchSize", {"jobName": TARGET_MULTI, "rolloutBatchSize": 1024}, None),
    ]
    out += [Malformed("LoRAAdapter", f, f"operator:{rule}", tuple(ch.items()), name)
            for rule, f, ch, name in adapters]
    return out
