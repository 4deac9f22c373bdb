"""Generate the CRDs from the pydantic models (`make manifests`; a test fails on drift).

pydantic emits JSON Schema (draft 2020-12 with $refs); a CRD needs a *structural* OpenAPI v3
schema: everything inlined, no nulls, `exclusiveMinimum` as a boolean, no `additionalProperties`
beside `properties`. This module does that translation, then adds what JSON Schema cannot say:
CEL rules, immutability, printer columns and the status subresource.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from kora_operator.api.adapter import LoRAAdapterSpec, LoRAAdapterStatus
from kora_operator.api.job import (
    GROUP,
    IMMUTABLE_SECTIONS,
    VERSION,
    LoRATrainingJobSpec,
)
from kora_operator.api.rules import JOB_RULES
from kora_operator.api.status import LoRATrainingJobStatus
from kora_trainer.config.rules import SPEC_RULES

Schema = dict[str, Any]
OUTPUT_DIRS = ("manifests/crds", "charts/kora/crds")
_DROP = {"title", "$defs"}


def _structural(node: Schema, defs: dict[str, Schema]) -> Schema:
    """Inline refs and rewrite JSON-Schema-isms into structural OpenAPI v3."""
    out: Schema = {}
    for key, value in _resolved(node, defs).items():
        _put(out, key, value, defs)
    if "properties" in out:
        out["type"] = "object"
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    return out


def _resolved(node: Schema, defs: dict[str, Schema]) -> Schema:
    """The node with its $ref inlined and a nullable union (`X | None`) collapsed to its one branch."""
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}  # the field's own description/default win over the class's
    any_of = node.pop("anyOf", None)
    if any_of is None:
        return node
    non_null = [s for s in any_of if s.get("type") != "null"]
    if node.get("x-kubernetes-int-or-string"):
        node["anyOf"] = non_null  # int-or-string keeps its two branches
        return node
    if len(non_null) == 1:
        return {**_structural(non_null[0], defs), **node}
    raise ValueError(f"unsupported union in schema: {any_of}")


def _put(out: Schema, key: str, value: Any, defs: dict[str, Schema]) -> None:
    """One key of a schema node, as structural OpenAPI v3 has it (or nothing)."""
    if key in _DROP or (key == "default" and value is None):
        return
    if key == "description":
        out[key] = " ".join(value.split())  # docstrings wrap; kubectl explain re-wraps
    elif key == "properties":
        out[key] = {k: _structural(v, defs) for k, v in value.items()}
    elif key == "items":
        out[key] = _structural(value, defs)
    elif key == "additionalProperties":
        if isinstance(value, dict):
            out[key] = _structural(value, defs)
    elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
        # JSON Schema 2020-12 gives the bound; OpenAPI v3.0 wants the bound plus a flag
        out[key.replace("exclusiveM", "m")], out[key] = value, True
    else:
        out[key] = value


def openapi_schema(model: type[BaseModel]) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema = _structural(raw, raw.get("$defs", {}))
    # A section whose Python default is an empty instance (default_factory=Section) defaults to
    # {} in the CRD too, so its fields' defaults apply (and CEL rules can read them) when a user
    # leaves the whole section out.
    for name, field in model.model_fields.items():
        factory = field.default_factory
        if factory is not None and isinstance(factory(), BaseModel):  # type: ignore[call-arg]
            schema["properties"][field.alias or name]["default"] = {}
    return schema


def _add_validations(schema: Schema, rules: list[dict[str, Any]]) -> None:
    schema.setdefault("x-kubernetes-validations", []).extend(rules)


def job_spec_schema() -> Schema:
    spec = openapi_schema(LoRATrainingJobSpec)
    _add_validations(spec, [r.cel_validation() for r in (*SPEC_RULES, *JOB_RULES) if r.cel])
    for name in IMMUTABLE_SECTIONS:
        _add_validations(spec["properties"][name], [{
            "rule": "self == oldSelf",
            "message": f"spec.{name} is immutable: it cannot change on a created job; delete "
                       f"and re-create the LoRATrainingJob (or create a new one) to change it",
        }])
    return spec


def _root(spec: Schema, status: Schema, description: str) -> Schema:
    return {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object: kora.dev/v1alpha1."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def _crd(kind: str, plural: str, short: str, root: Schema, columns: list[Schema]) -> Schema:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "kora"}},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind, "listKind": f"{kind}List", "plural": plural,
                "singular": kind.lower(), "shortNames": [short], "categories": ["kora"],
            },
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


def _column(name: str, type_: str, path: str, description: str, priority: int = 0) -> Schema:
    col: Schema = {"name": name, "type": type_, "jsonPath": path, "description": description}
    if priority:
        col["priority"] = priority
    return col


def loratrainingjob_crd() -> Schema:
    root = _root(job_spec_schema(), openapi_schema(LoRATrainingJobStatus),
                 "A LoRA reinforcement-learning post-training job, run on Ray (KubeRay or an existing cluster).")
    return _crd("LoRATrainingJob", "loratrainingjobs", "ltj", root, [
        _column("Mode", "string", ".status.syncMode", "Weight-sync mode in effect"),
        _column("Phase", "string", ".status.phase", "Pending, Provisioning, Running, Suspended, Succeeded, Failed"),
        _column("Step", "integer", ".status.progress.step", "Optimizer steps done"),
        _column("Reward", "number", ".status.progress.rewardMean", "Mean reward of the last step"),
        _column("Age", "date", ".metadata.creationTimestamp", "Time since creation"),
        _column("Total", "integer", ".status.progress.totalSteps", "Steps the job will run", 1),
        _column("Synced", "integer", ".status.progress.lastSync.adapterVersion",
                "Policy version the engines serve", 1),
        _column("RayJob", "string", ".status.rayJobName", "RayJob or Ray submission id", 1),
        _column("ETA", "string", ".status.progress.eta", "Time left at the measured step rate", 1),
    ])


def adapter_spec_schema() -> Schema:
    spec = openapi_schema(LoRAAdapterSpec)
    # the trainer has no route that changes a registered adapter (config/adapter_runs.py): a change would
    # silently not apply, so there is none
    _add_validations(spec, [{
        "rule": "self == oldSelf",
        "message": "the spec of a LoRAAdapter is immutable: its job's trainer cannot change a registered adapter; "
                   "delete the LoRAAdapter and create it again (or one under another name) to change it",
    }])
    return spec


def loraadapter_crd() -> Schema:
    root = _root(adapter_spec_schema(), openapi_schema(LoRAAdapterStatus),
                 "One adapter of a multi-adapter LoRATrainingJob (multiLora.maxAdapters > 0).")
    return _crd("LoRAAdapter", "loraadapters", "lad", root, [
        _column("Job", "string", ".spec.jobName", "The LoRATrainingJob serving this adapter"),
        _column("Phase", "string", ".status.phase", "Pending, Training, Retiring, Succeeded, Retired, Failed"),
        _column("Step", "integer", ".status.step", "This adapter's optimizer steps"),
        _column("Reward", "number", ".status.rewardMean", "Mean reward of its last step"),
        _column("Version", "integer", ".status.version", "Adapter version the engines serve"),
        _column("Age", "date", ".metadata.creationTimestamp", "Time since creation"),
        _column("Total", "integer", ".status.numSteps", "The step it retires at", 1),
        _column("Slot", "integer", ".status.slot", "The trainer's adapter slot it holds", 1),
    ])


def render(crd: Schema) -> str:
    header = "# Generated by `make manifests` from the pydantic models in kora_operator.api. Do not edit.\n"
    return header + yaml.safe_dump(crd, sort_keys=False, width=100)


def generated_files() -> dict[str, str]:
    """File name -> YAML text for every CRD."""
    files = {}
    for crd in (loratrainingjob_crd(), loraadapter_crd()):
        files[f"{GROUP}_{crd['spec']['names']['plural']}.yaml"] = render(crd)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="repository root")
    parser.add_argument("--check", action="store_true", help="fail if the committed CRDs differ")
    args = parser.parse_args(argv)
    drift = False
    for name, text in generated_files().items():
        for out_dir in OUTPUT_DIRS:
            path = Path(args.root) / out_dir / name
            current = path.read_text() if path.exists() else ""
            if current == text:
                continue
            if args.check:
                drift = True
                sys.stdout.writelines(difflib.unified_diff(
                    current.splitlines(True), text.splitlines(True), str(path), "generated", n=1))
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                print(f"wrote {path}")
    if drift:
        print("CRDs are stale: run `make manifests` and commit the result", file=sys.stderr)
    return 1 if drift else 0


if __name__ == "__main__":
    raise SystemExit(main())
