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
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from fuzzspecs import Malformed, targets
from localcluster import wait_for
from operatorkit import KUBERAY_CHILDREN
from raykit import ray_job_doc, submissions_by_uid
from specs import valid_job

GROUP, VERSION = "kora.dev", "v1alpha1"
JOB_LABEL = "kora.dev/job-name"
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
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


def _children_by_job(custom: Any, core: Any, ns: str, jobs: set[str]) -> tuple[dict[str, Counter[str]], int]:
    """The ConfigMaps, Secrets, NetworkPolicies and RayJobs labelled as a job's: counted by kind for each of `jobs`,
    and how many name a job that does not exist (orphans)."""
    existing = {i["metadata"]["name"] for i in custom.list_namespaced_custom_object(
        GROUP, VERSION, ns, "loratrainingjobs")["items"]}
    policies = client.NetworkingV1Api(core.api_client).list_namespaced_network_policy
    labels = [(kind, o.metadata.labels or {}) for kind, lister in
              (("ConfigMap", core.list_namespaced_config_map), ("Secret", core.list_namespaced_secret),
               ("NetworkPolicy", policies)) for o in lister(ns, label_selector=JOB_LABEL).items]
    labels += [("RayJob", r["metadata"].get("labels") or {}) for r in _rayjobs(custom, ns)]
    per_job: dict[str, Counter[str]] = {n: Counter() for n in jobs}
    orphans = 0
    for kind, label in labels:
        job = label.get(JOB_LABEL)
        if job in per_job:
            per_job[job][kind] += 1
        elif job not in existing:
            orphans += 1
    return per_job, orphans


def _children_of(custom: Any, core: Any, ns: str, jobs: set[str]) -> int:
    return sum(sum(c.values()) for c in _children_by_job(custom, core, ns, jobs)[0].values())


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


class WatchedNames:
    """The names of one kind's objects in a namespace, kept by a watch on a thread of this object's own: a count
    that costs nothing per look, waited on without polling. (A LIST of 500 RayJobs is ~6 MB, managedFields and
    all, and the burst looked 20 times a second: on 2 cores that polling took the API server's and the test's
    time from the operator.)"""

    def __init__(self, custom: Any, group: str, version: str, ns: str, plural: str) -> None:
        self._list, self._args = custom.list_namespaced_custom_object, (group, version, ns, plural)
        self._names: set[str] = set()
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # what stopped the thread, if anything did
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, name=f"watch-{plural}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._follow()
        except BaseException as e:  # told to the waiter, not lost with the thread
            self.error = e
        with self._changed:
            self._changed.notify_all()

    def _seen(self, names: set[str]) -> None:
        with self._changed:
            self._names = names
            self._changed.notify_all()

    def _follow(self) -> None:
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:  # (re)list, then watch from there
                    listed = self._list(*self._args, _headers={"Accept": METADATA_LIST})
                    self._seen({i["metadata"]["name"] for i in listed.get("items") or ()})
                    rv = listed["metadata"]["resourceVersion"]
                # short watches, so that stop() is seen within seconds (stream() wants the API method itself)
                for ev in self._watch.stream(self._list, *self._args, resource_version=rv, timeout_seconds=2):
                    obj = ev["object"]
                    if ev["type"] == "ERROR":  # e.g. 410 Gone: the version fell out of the watch window
                        rv = None
                        break
                    rv = obj["metadata"]["resourceVersion"]
                    name = obj["metadata"]["name"]
                    self._seen(self._names - {name} if ev["type"] == "DELETED" else self._names | {name})
            except ApiException:
                rv = None

    def wait_for_count(self, n: int, timeout: float, what: str) -> int:
        """Block until at least `n` objects exist (woken by each watch event); their count."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self._names) < n:
                if self.error is not None:
                    raise RuntimeError(f"the watch stopped while waiting for {what}: {self.error!r}") from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what} (have {len(self._names)})")
                self._changed.wait(left)
            return len(self._names)

    def stop(self) -> None:
        self._stop.set()
        self._watch.stop()
        self._thread.join(timeout=15)

    def __enter__(self) -> WatchedNames:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class _Killer:
    """The operator, killed and started again, with the time each part of a kill_during_burst wave took (`spent`,
    seconds by phase; `restarts`, each start until the operator was live) and each Secret's value when first seen."""

    custom: Any
    core: Any
    op: Any
    ns: str
    timeout: float
    spent: Counter[str] = field(default_factory=Counter)
    restarts: list[float] = field(default_factory=list)
    first_seen: dict[str, Any] = field(default_factory=dict)

    def remember_secrets(self) -> dict[str, Any]:
        listed = self.core.list_namespaced_secret(self.ns, label_selector=JOB_LABEL).items
        for s in listed:
            self.first_seen.setdefault(s.metadata.name, s.data)
        return {s.metadata.name: s.data for s in listed}

    def wave(self, names: list[str], target: int, rayjobs: WatchedNames) -> None:
        """Create the jobs `names`, SIGKILL the operator once `target` RayJobs exist, start it again."""
        t = time.monotonic()
        for name in names:
            self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, "loratrainingjobs", valid_job(name))
        self.spent["create"] += time.monotonic() - t
        t = time.monotonic()
        rayjobs.wait_for_count(target, timeout=self.timeout, what=f"{target} RayJobs")
        self.spent["wait_for_rayjobs"] += time.monotonic() - t
        t = time.monotonic()
        self.op.kill()
        self.remember_secrets()
        self.spent["kill"] += time.monotonic() - t
        t = time.monotonic()
        self.op.start()
        self.restarts.append(time.monotonic() - t)


def kill_during_burst(custom: Any, core: Any, op: Any, ns: str, jobs: int, kills: int, seed: int,
                      timeout: float = 300.0) -> dict[str, Any]:
    """`jobs` valid jobs created in `kills` waves; during each wave the operator is SIGKILLed once a random number
    of the wave's RayJobs exist (an observable moment in the middle of reconciling), then started again. Then:
    every job converges to Pending with exactly one child of each kind, no child is left without its job, and
    no Secret's value changed after it was first seen (a token or key rotated by a second create)."""
    rng = random.Random(seed)
    per_wave = max(1, -(-jobs // kills))  # ceil: all `jobs` within the `kills` waves
    t0 = time.monotonic()
    made = 0
    killer = _Killer(custom, core, op, ns, timeout)
    with WatchedNames(custom, "ray.io", "v1", ns, "rayjobs") as rayjobs:
        for _ in range(kills):
            wave = [f"burst-{i}" for i in range(made, min(jobs, made + per_wave))]
            killer.wave(wave, made + rng.randint(0, len(wave)), rayjobs)  # kill once this many RayJobs exist
            made += len(wave)
    spent = killer.spent
    spent["restart"] = sum(killer.restarts)
    names = {f"burst-{i}" for i in range(made)}
    t = time.monotonic()

    def converged() -> bool:
        items = custom.list_namespaced_custom_object(GROUP, VERSION, ns, "loratrainingjobs")["items"]
        return sum((i.get("status") or {}).get("phase") == "Pending" for i in items if i["metadata"]["name"] in names) \
            == len(names)

    wait_for(converged, timeout=timeout, interval=0.5, what=f"all {len(names)} jobs Pending")
    spent["converge"] = time.monotonic() - t
    per_job, orphans = _children_by_job(custom, core, ns, names)
    want = Counter(KUBERAY_CHILDREN)
    secrets = killer.remember_secrets()
    return {
        "jobs": len(names), "kills": kills,
        "jobs_not_exactly_one_set": sorted(n for n, c in per_job.items() if c != want),
        "orphans": orphans,
        "secrets_changed": sorted(n for n, d in killer.first_seen.items() if secrets.get(n) != d),
        "seconds": round(time.monotonic() - t0, 1), "seconds_by_phase": {k: round(v, 1) for k, v in spent.items()},
        "restart_seconds": _spread(killer.restarts),
    }


def _spread(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50": round(xs[len(xs) // 2], 2), "max": round(xs[-1], 2)} if xs else {}


def kill_table(r: dict[str, Any]) -> str:
    rows = [("operator SIGKILLs during the burst", r["kills"]), ("jobs", r["jobs"]),
            ("jobs without exactly one set of children", len(r["jobs_not_exactly_one_set"])),
            ("orphaned children", r["orphans"]), ("Secrets whose value changed", len(r["secrets_changed"])),
            ("seconds", f"{r['seconds']} {r['seconds_by_phase']}"),
            ("a restart until the operator is live (s)", r["restart_seconds"])]
    return "\n".join(f"  {k:44}{v}" for k, v in rows)


RAY_CHILDREN = {"ConfigMap": 1, "Secret": 1}  # a runtime-Ray job's: its config and its control-plane token
_RAY_END = (("Running", "RUNNING"), ("Succeeded", "SUCCEEDED"))  # (job phase, its submission's status): sleep, exit 0


def ray_kill_during_burst(custom: Any, core: Any, op: Any, head: Any, ns: str, homes: Path, jobs: int, kills: int,
                          seed: int, timeout: float = 300.0) -> dict[str, Any]:
    """`jobs` runtime-Ray jobs on the local Ray head `head` (the scripted trainer: every other one runs until
    stopped, the rest exit 0 at once) created in `kills` waves; during each wave the operator is SIGKILLed once a
    random number of the wave's Ray submissions exist (so between two POSTs, or between a POST and the status write
    that follows it), then started again. Then: every job converges to Running on a RUNNING submission (or
    Succeeded on a SUCCEEDED one), the submission its status.rayJobName names; each job's uid has exactly one
    submission (the Jobs API's metadata kora.dev/uid: a finished one is not submitted again either) and one set of
    children."""
    rng = random.Random(seed)
    per_wave = max(1, -(-jobs // kills))  # ceil: all `jobs` within the `kills` waves
    t0 = time.monotonic()
    uids: dict[str, str] = {}  # job name -> uid
    at_kill: list[dict[str, int]] = []  # what each kill left behind (the operator dead: nothing moves but Ray)
    restarts: list[float] = []

    def ours() -> dict[str, dict[str, Any]]:  # uid -> its submissions
        return {u: subs for u, subs in submissions_by_uid(head).items() if u in uids.values()}

    def statuses() -> dict[str, dict[str, Any]]:
        items = custom.list_namespaced_custom_object(GROUP, VERSION, ns, "loratrainingjobs")["items"]
        return {i["metadata"]["name"]: i.get("status") or {} for i in items}

    def left_behind() -> dict[str, int]:
        """Where the jobs stood when the operator died. The operator names a submission in the status before it
        POSTs it (runtimes/ray.py), so a job caught mid-submission is named and not on the head yet, or on the
        head and its status not yet moved on (Pending still)."""
        subs, status = ours(), statuses()
        named = {n for n in uids if status.get(n, {}).get("rayJobName")}
        submitted = {n for n, u in uids.items() if subs.get(u)}
        moved_on = {n for n in uids if status.get(n, {}).get("phase") in ("Running", "Succeeded", "Failed")}
        return {"jobs": len(uids), "submitted": len(submitted), "named_not_submitted": len(named - submitted),
                "submitted_status_pending": len(submitted - moved_on)}

    for _ in range(kills):
        wave = range(len(uids), min(jobs, len(uids) + per_wave))
        before = sum(len(s) for s in ours().values())
        for i in wave:
            name = f"ray-burst-{i}"
            script = {"mode": "sleep"} if i % 2 == 0 else {"mode": "exit", "code": 0, "say": "done"}
            doc = ray_job_doc(name, homes / name, head.dashboard_url, script)
            uids[name] = custom.create_namespaced_custom_object(GROUP, VERSION, ns, "loratrainingjobs", doc)[
                "metadata"]["uid"]
        target = before + rng.randint(0, len(wave))  # kill once this many submissions exist
        wait_for(lambda at=target: sum(len(s) for s in ours().values()) >= at, timeout=timeout, interval=0.05,
                 what=f"{target} Ray submissions")
        op.kill()
        at_kill.append(left_behind())
        t = time.monotonic()
        op.start()
        restarts.append(time.monotonic() - t)

    def converged() -> bool:
        subs, status = ours(), statuses()
        return all((status.get(n, {}).get("phase"),
                    (subs.get(u) or {}).get(status[n].get("rayJobName") or "", {}).get("status")) == _RAY_END[i % 2]
                   for i, (n, u) in enumerate(uids.items()))

    wait_for(converged, timeout=timeout, interval=0.5,
             what=f"all {len(uids)} jobs Running / Succeeded on the submission their status names")
    subs = ours()
    per_job, orphans = _children_by_job(custom, core, ns, set(uids))
    return {
        "jobs": len(uids), "kills": kills, "at_kill": at_kill,
        "kills_mid_submission": sum(k["named_not_submitted"] + k["submitted_status_pending"] > 0 for k in at_kill),
        "kills_between_status_write_and_post": sum(k["named_not_submitted"] > 0 for k in at_kill),
        "submissions": sum(len(s) for s in subs.values()),
        "jobs_not_exactly_one_submission": sorted(n for n, u in uids.items() if len(subs.get(u) or {}) != 1),
        "jobs_not_exactly_one_set": sorted(n for n, c in per_job.items() if c != Counter(RAY_CHILDREN)),
        "orphans": orphans, "seconds": round(time.monotonic() - t0, 1), "restart_seconds": _spread(restarts),
    }


def ray_kill_table(r: dict[str, Any]) -> str:
    rows = [("operator SIGKILLs during the burst", r["kills"]),
            ("  with a job mid-submission", r["kills_mid_submission"]),
            ("  with a job named, not yet POSTed", r["kills_between_status_write_and_post"]),
            ("runtime-Ray jobs", r["jobs"]), ("Ray job submissions", r["submissions"]),
            ("jobs without exactly one submission", len(r["jobs_not_exactly_one_submission"])),
            ("jobs without exactly one set of children", len(r["jobs_not_exactly_one_set"])),
            ("orphaned children", r["orphans"]), ("seconds", r["seconds"]),
            ("a restart until the operator is live (s)", r["restart_seconds"])]
    return "\n".join(f"  {k:44}{v}" for k, v in rows)
