"""Malformed LoRATrainingJobs and LoRAAdapters, generated from the CRDs' own schemas (which the pydantic models
generate: api/crd.py), for the operator chaos run (bench/chaos_operator.py, tests/integration/test_chaos_operator.py).

Each malformation breaks one thing the schema states — a wrong type, a number past its minimum or maximum, a string
outside its enum or past its length, a required field left out — or one CEL rule (specs.VIOLATIONS). Every one
of them must be refused: at apply by the API server (422), or by the operator's validation (Failed,
ValidationFailed). `field` is the dotted path the refusal must name.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specs import VIOLATIONS, set_path, valid_job

ROOT = Path(__file__).resolve().parents[1]
DELETE = object()  # the value that means "leave the field out"
WRONG_TYPE: dict[str, Any] = {"integer": "not-a-number", "number": "not-a-number", "string": 12345,
                              "boolean": "maybe", "object": "not-an-object", "array": "not-a-list"}


@dataclass(frozen=True)
class Malformed:
    kind: str  # LoRATrainingJob | LoRAAdapter
    field: str  # dotted under spec, e.g. lora.rank
    how: str  # wrong-type, below-minimum, above-maximum, not-in-enum, too-long, empty, missing-required, rule:<id>
    changes: tuple[tuple[str, Any], ...]  # (dotted path, value or DELETE)

    def doc(self, name: str) -> dict[str, Any]:
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


def sample(n: int, seed: int) -> list[Malformed]:
    """n malformations, seeded: the whole list shuffled, again and again until n (so each appears about as often)."""
    rng = random.Random(seed)
    pool = all_malformed()
    out: list[Malformed] = []
    while len(out) < n:
        batch = list(pool)
        rng.shuffle(batch)
        out += batch[: n - len(out)]
    return out
