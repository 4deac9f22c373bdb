"""The operator chaos run's fuzzed-spec part, shared by its test (CI size) and bench/chaos_operator.py (full size).

Malformed objects (fuzzspecs.py) are created through the API server while the operator runs, a valid job after
every `good_every` of them. Each malformed one must be refused naming its field — at apply (422), or by the
operator (Failed, ValidationFailed) — and get no child; every valid job must get its children; the operator must
stay up. The operator-only ones (fuzzspecs.operator_only) must pass apply and be refused by the operator with a
message naming the field its rule is about.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fuzzspecs import Malformed, targets
from localcluster import wait_for
from specs import valid_job

GROUP, VERSION = "kora.dev", "v1alpha1"
JOB_LABEL = "kora.dev/job-name"
PLURAL = {"LoRATrainingJob": "loratrainingjobs", "LoRAAdapter": "loraadapters"}


def names_field(message: str, m: Malformed) -> bool:
    """The message names a field the malformation changed (a rule's, any of the fields it relates); an
    operator-only one's names the field of its rule, as the operator spells it."""
    if m.operator_only:
        return m.field in message
    return any(f"spec.{f}" in message or f in message or f.rsplit(".", 1)[-1] in message for f, _ in m.changes)


@dataclass
class _Applied:
    """What the API server made of the malformed objects, and the valid jobs applied in between."""

    rejected: Counter[str] = field(default_factory=Counter)  # by how (its kind before ':')
    unnamed: list[str] = field(default_factory=list)  # refusals that do not name the field
    refused_at_apply: list[str] = field(default_factory=list)  # operator-only ones the API server refused after all
    accepted: dict[str, Malformed] = field(default_factory=dict)  # by object name
    good: list[str] = field(default_factory=list)


def _apply_all(custom: Any, ns: str, items: list[Malformed], good_every: int) -> _Applied:
    out = _Applied()
    if any(m.operator_only for m in items):
        for doc in targets():  # what the operator-only LoRAAdapters name
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, "loratrainingjobs", doc)
            out.good.append(doc["metadata"]["name"])
    for i, m in enumerate(items):
        name = m.name or f"fuzz-{i}"
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL[m.kind], m.doc(name))
            out.accepted[name] = m
        except ApiException as e:
            message = str(json.loads(e.body or "{}").get("message") or e.body)
            if e.status != 422:
                raise AssertionError(f"{m}: the API server answered {e.status}, not 422: {message}") from None
            out.rejected[m.how.split(":")[0]] += 1
            if m.operator_only:
                out.refused_at_apply.append(f"{m.kind} {m.field} {m.how}: {message[:300]}")
            if not names_field(message, m):
                out.unnamed.append(f"{m.kind} {m.field} {m.how}: {message[:300]}")
        if i % good_every == 0:
            out.good.append(f"good-{i}")
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, "loratrainingjobs", valid_job(out.good[-1]))
    return out


def _operator_verdicts(custom: Any, ns: str, accepted: dict[str, Malformed], timeout: float) -> dict[str, str]:
    """Wait for every accepted object to be Failed/ValidationFailed; its message, by name."""
    def verdicts() -> dict[str, str] | None:
        out = {}
        for name, m in accepted.items():
            obj = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL[m.kind], name)
            status = obj.get("status") or {}
            failed = [c for c in status.get("conditions") or [] if c.get("reason") == "ValidationFailed"]
            if status.get("phase") != "Failed" or not failed:
                return None
            out[name] = failed[0].get("message") or ""
        return out

    if not accepted:
        return {}
    try:
        return dict(wait_for(verdicts, timeout=timeout, interval=0.5,
                             what="every accepted malformed object Failed/ValidationFailed"))
    except TimeoutError:
        now = {n: (custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL[m.kind], n).get("status") or {})
               for n, m in accepted.items()}
        stuck = {f"{accepted[n]}": s.get("phase") for n, s in now.items() if s.get("phase") != "Failed"}
        raise AssertionError(f"accepted at apply and not refused by the operator: {stuck}") from None


def _rayjobs(custom: Any, ns: str) -> list[dict[str, Any]]:
    return list(custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"])


def _children_of(custom: Any, core: Any, ns: str, jobs: set[str]) -> int:
    """ConfigMaps, Secrets, NetworkPolicies and RayJobs labelled as one of `jobs`'."""
    policies = client.NetworkingV1Api(core.api_client).list_namespaced_network_policy
    n = 0
    for lister in (core.list_namespaced_config_map, core.list_namespaced_secret, policies):
        n += sum(1 for o in lister(ns, label_selector=JOB_LABEL).items if o.metadata.labels.get(JOB_LABEL) in jobs)
    return n + sum(1 for r in _rayjobs(custom, ns) if r["metadata"].get("labels", {}).get(JOB_LABEL) in jobs)


def fuzz_specs(custom: Any, core: Any, ns: str, items: list[Malformed], good_every: int = 10,
               timeout: float = 120.0) -> dict[str, Any]:
    t0 = time.monotonic()
    applied = _apply_all(custom, ns, items, good_every)
    failed_by_operator = _operator_verdicts(custom, ns, applied.accepted, timeout)
    for name, message in failed_by_operator.items():
        m = applied.accepted[name]
        if not names_field(message, m):
            applied.unnamed.append(f"{m.kind} {m.field} {m.how} (operator): {message[:300]}")

    def rayjobs() -> set[str]:
        return {i["metadata"]["name"] for i in _rayjobs(custom, ns)}

    want = {f"{g}-ray" for g in applied.good}
    wait_for(lambda: want <= rayjobs(), timeout=timeout, interval=0.5,
             what="every valid job applied in between to get its RayJob")
    children = _children_of(custom, core, ns, {m.name or f"fuzz-{i}" for i, m in enumerate(items)})
    return {
        "malformed": len(items), "distinct": len({repr(m) for m in items}),
        "rejected_at_apply": sum(applied.rejected.values()), "rejected_by_kind": dict(sorted(applied.rejected.items())),
        "failed_validation_by_operator": len(failed_by_operator),
        "operator_only": sum(m.operator_only for m in items),
        "operator_only_failed_by_operator": sum(m.operator_only for m in applied.accepted.values()),
        "operator_only_refused_at_apply": applied.refused_at_apply,
        "operator_only_rules": sorted({m.how.split(":", 1)[1] for m in items if m.operator_only}),
        "refusals_not_naming_the_field": applied.unnamed, "child_objects_of_malformed": children,
        "valid_jobs_in_between": len(applied.good), "valid_jobs_reconciled": len(want & rayjobs()),
        "seconds": round(time.monotonic() - t0, 1),
    }


def table(r: dict[str, Any]) -> str:
    rows = [("malformed objects applied", f"{r['malformed']} ({r['distinct']} distinct)"),
            ("rejected at apply (422)", f"{r['rejected_at_apply']} {r['rejected_by_kind']}"),
            ("Failed/ValidationFailed by the operator", r["failed_validation_by_operator"]),
            ("  of which past the CRD (operator-only)",
             f"{r['operator_only_failed_by_operator']} of {r['operator_only']} "
             f"({len(r['operator_only_rules'])} rules)"),
            ("refusals not naming the field", len(r["refusals_not_naming_the_field"])),
            ("child objects of malformed ones", r["child_objects_of_malformed"]),
            ("valid jobs applied in between / reconciled",
             f"{r['valid_jobs_in_between']} / {r['valid_jobs_reconciled']}"),
            ("operator restarts (crashes)", r.get("operator_crashes", "?")),
            ("seconds", r["seconds"])]
    return "\n".join(f"  {k:44}{v}" for k, v in rows)


def kill_during_burst(custom: Any, core: Any, op: Any, ns: str, jobs: int, kills: int, seed: int,
                      timeout: float = 300.0) -> dict[str, Any]:
    """`jobs` valid jobs created in `kills` waves; during each wave the operator is SIGKILLed once a random number
    of the wave's RayJobs exist (an observable moment in the middle of reconciling), then started again. Then:
    every job converges to Pending with exactly one child of each kind, no child is left without its job, and
    no Secret's value changed after it was first seen (a token or key rotated by a second create)."""
    rng = random.Random(seed)
    per_wave = max(1, jobs // kills)
    t0 = time.monotonic()
    made = 0
    first_seen: dict[str, Any] = {}

    def rayjobs() -> int:
        return len(custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"])

    def remember_secrets() -> None:
        for s in core.list_namespaced_secret(ns, label_selector="kora.dev/job-name").items:
            first_seen.setdefault(s.metadata.name, s.data)

    for _ in range(kills):
        wave = range(made, min(jobs, made + per_wave)) if made < jobs else range(0)
        for i in wave:
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, "loratrainingjobs", valid_job(f"burst-{i}"))
        target = made + rng.randint(0, len(wave))  # kill once this many RayJobs exist
        made += len(wave)
        wait_for(lambda at=target: rayjobs() >= at, timeout=timeout, interval=0.05, what=f"{target} RayJobs")
        op.kill()
        remember_secrets()
        op.start()
    names = {f"burst-{i}" for i in range(made)}

    def converged() -> bool:
        items = custom.list_namespaced_custom_object(GROUP, VERSION, ns, "loratrainingjobs")["items"]
        return sum((i.get("status") or {}).get("phase") == "Pending" for i in items if i["metadata"]["name"] in names) \
            == len(names)

    wait_for(converged, timeout=timeout, interval=0.5, what=f"all {len(names)} jobs Pending")
    per_job: dict[str, Counter[str]] = {n: Counter() for n in names}
    orphans = 0
    children = [("ConfigMap", o) for o in core.list_namespaced_config_map(ns, label_selector="kora.dev/job-name").items]
    children += [("Secret", o) for o in core.list_namespaced_secret(ns, label_selector="kora.dev/job-name").items]
    for kind, o in children:
        job = o.metadata.labels["kora.dev/job-name"]
        if job in per_job:
            per_job[job][kind] += 1
        else:
            orphans += 1
    for r in custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"]:
        job = r["metadata"]["labels"].get("kora.dev/job-name")
        if job in per_job:
            per_job[job]["RayJob"] += 1
        else:
            orphans += 1
    want = Counter({"ConfigMap": 1, "Secret": 2, "RayJob": 1})
    remember_secrets()
    listed = core.list_namespaced_secret(ns, label_selector="kora.dev/job-name").items
    secrets = {s.metadata.name: s.data for s in listed}
    return {
        "jobs": len(names), "kills": kills,
        "jobs_not_exactly_one_set": sorted(n for n, c in per_job.items() if c != want),
        "orphans": orphans, "secrets_changed": sorted(n for n, d in first_seen.items() if secrets.get(n) != d),
        "seconds": round(time.monotonic() - t0, 1),
    }


def kill_table(r: dict[str, Any]) -> str:
    rows = [("operator SIGKILLs during the burst", r["kills"]), ("jobs", r["jobs"]),
            ("jobs without exactly one set of children", len(r["jobs_not_exactly_one_set"])),
            ("orphaned children", r["orphans"]), ("Secrets whose value changed", len(r["secrets_changed"])),
            ("seconds", r["seconds"])]
    return "\n".join(f"  {k:44}{v}" for k, v in rows)
