"""`kora validate FILE`, `kora render FILE` and `kora plan FILE` (plugged into the `kora` CLI by entry points)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kora_operator.api.job import LoRATrainingJob, RuntimeKind
from kora_operator.builders.children import build_children
from kora_operator.builders.configmap import dump_yaml
from kora_operator.builders.secret import ENGINE_KEY_PLACEHOLDER, TOKEN_PLACEHOLDER, new_token
from kora_operator.settings import Settings
from kora_operator.validation import validate_adapter, validate_job
from kora_trainer.config.load import ConfigError
from kora_trainer.config.placement import Node, parse_nodes, plan_job


def _documents(path: str) -> list[dict[str, Any]]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    return [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]


def _name(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name', '?')}"


def validate(args: argparse.Namespace) -> int:
    """Print every problem of every document; exit 1 if any is an error."""
    failed = False
    for path in args.files:
        try:
            docs = _documents(path)
        except (OSError, yaml.YAMLError) as e:
            print(f"{path}: cannot read: {e}", file=sys.stderr)
            failed = True
            continue
        jobs: dict[str, LoRATrainingJob] = {}
        for doc in docs:
            if doc.get("kind") != "LoRATrainingJob":
                continue
            job, problems = validate_job(doc)
            if job is not None:
                jobs[str(job.metadata.get("name"))] = job
            failed |= _report(path, _name(doc), problems)
        for doc in docs:
            if doc.get("kind") != "LoRAAdapter":
                continue
            job_name = str((doc.get("spec") or {}).get("jobName"))
            _, problems = validate_adapter(doc, jobs.get(job_name))
            failed |= _report(path, _name(doc), problems)
    return 1 if failed else 0


def _report(path: str, what: str, problems: list[Any]) -> bool:
    for p in problems:
        print(f"{path}: {what}: {p}", file=sys.stderr if p.severity == "error" else sys.stdout)
    if not any(p.severity == "error" for p in problems):
        print(f"{path}: {what}: valid")
        return False
    return True


def _jobs(path: str) -> Iterator[tuple[str, LoRATrainingJob | None]]:
    """(name, job) for each LoRATrainingJob of FILE; job None when it is invalid (its problems printed)."""
    for doc in _documents(path):
        if doc.get("kind") != "LoRATrainingJob":
            continue
        job, problems = validate_job(doc)
        if job is None or any(p.severity == "error" for p in problems):
            for p in problems:
                print(f"{path}: {_name(doc)}: {p}", file=sys.stderr)
            job = None
        yield _name(doc), job


def render(args: argparse.Namespace) -> int:
    """Print, as YAML, the objects the operator would create for each job in FILE.

    The Secrets' token and engine key are placeholders unless --generate-token: render is a preview
    meant to be diffed, reviewed and pasted into tickets, so its output is reproducible and carries no
    credential; the operator makes the real ones once, when it creates the Secrets. The NetworkPolicy
    is the one an operator with this environment's settings (KORA_NETWORK_POLICY, POD_NAMESPACE, ...) makes.
    """
    out: list[dict[str, Any]] = []
    peers = Settings.from_env().network_peers()
    for _, job in _jobs(args.file):
        if job is None:
            return 1
        job.metadata.setdefault("namespace", args.namespace)
        token, key = (new_token(), new_token()) if args.generate_token else (TOKEN_PLACEHOLDER, ENGINE_KEY_PLACEHOLDER)
        out.extend(build_children(job, token, key, peers))
    sys.stdout.write(dump_yaml(out))
    return 0


def register_validate(sub: Any) -> None:
    p = sub.add_parser("validate", help="check LoRATrainingJob/LoRAAdapter YAML against every rule")
    p.add_argument("files", nargs="+", metavar="FILE", help="YAML file(s); - for stdin")
    p.set_defaults(func=validate)


def register_render(sub: Any) -> None:
    p = sub.add_parser("render", help="print the objects the operator would create for FILE")
    p.add_argument("file", metavar="FILE", help="YAML file with LoRATrainingJob(s); - for stdin")
    p.add_argument("-n", "--namespace", default="default", help="namespace when the job names none")
    p.add_argument("--generate-token", action="store_true",
                   help="put a fresh random control-plane token and engine admin key in the Secrets instead of "
                        "placeholders")
    p.set_defaults(func=render)


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def kuberay_nodes(job: LoRATrainingJob) -> list[Node]:
    """The Ray nodes the job's RayJob makes: the head (the driver; no GPU unless it is the only pod) and
    resources.workers worker pods of resources.gpusPerWorker GPUs."""
    r = job.spec.resources
    head = Node("head", _cpus(r.head_cpu), r.head_gpus)
    return [head] + [Node(f"worker-{i}", _cpus(r.cpu), r.gpus_per_worker) for i in range(r.workers)]


def plan(args: argparse.Namespace) -> int:
    """Print where each job of FILE would run: ranks, engines, the weight-update group
    (kora_trainer.config.placement)."""
    failed = False
    for name, job in _jobs(args.file):
        if job is None:
            failed = True
            continue
        nodes = parse_nodes(args.nodes) if args.nodes else kuberay_nodes(job)
        try:
            job_plan = plan_job(job.spec, nodes)
        except ConfigError as e:
            print(f"{args.file}: {name}: {e}", file=sys.stderr)
            failed = True
            continue
        if args.json:
            print(json.dumps({"job": name, **job_plan.as_dict()}))
            continue
        where = "--nodes " + args.nodes if args.nodes else "resources.workers x gpusPerWorker"
        if job.spec.runtime.kind is RuntimeKind.RAY and not args.nodes:
            where += " (runtime Ray: the existing cluster's nodes are not known here; --nodes plans on another shape)"
        print(f"{name} on {len(nodes)} node(s) from {where}:")
        print("\n".join(job_plan.lines()))
    return 1 if failed else 0


def register_plan(sub: Any) -> None:
    p = sub.add_parser("plan", help="print where each job in FILE would run, without starting anything")
    p.add_argument("file", metavar="FILE", help="YAML file with LoRATrainingJob(s); - for stdin")
    p.add_argument("--nodes", default=None, metavar="NxG",
                   help="plan on N nodes of G GPUs instead of the job's resources (e.g. 2x8)")
    p.add_argument("--json", action="store_true", help="one JSON object per job, for tools")
    p.set_defaults(func=plan)
