"""What the operator remembers between reconciles, so that a burst of jobs costs fewer API round trips.

Both are hints, never the truth: a reconcile that trusts one only skips a call whose answer it already knows, and
every way the hint can go stale is covered — by a watch event (a RayJob deleted, an adapter deleted) or by
age (a child deleted by a user is found missing again within `recheck_s`).

- KnownChildren: per job uid, when every child was last seen or made. An event-driven reconcile of a job whose
  children were confirmed within `recheck_s` reads only its RayJob (for the status) instead of re-checking five
  objects (two of them Secrets the operator may create but not read: re-creating one costs a 409 each time).
  After a restart a job whose RayJob exists (kopf's listing; the RayJob is made last) starts out known, so its
  resume reads only the RayJob: a child deleted while the operator was down comes back at the first reconcile
  after the recheck time.
  It also keeps which version of the job's RayJob its status was last derived from: the RayJob's watch event
  for that very version (the echo of the create that made it, or of the listing after a restart) then changes
  nothing and is not reconciled; any later version is, and a deleted RayJob forgets both.
- AdapterIndex: which LoRAAdapters name which job, kept from the adapters' watch (kopf lists them all at start,
  then streams every change; an adapter's jobName is immutable). A job's reconcile then syncs its adapters
  without LISTing every adapter of the namespace; for the jobs no adapter names (most) it costs nothing.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable


class KnownChildren:
    def __init__(self, recheck_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.recheck_s = recheck_s
        self._clock = clock
        self._seen: dict[str, float] = {}
        self._ray_versions: dict[str, str] = {}
        self._lock = threading.Lock()

    def known(self, uid: str) -> bool:
        """All of the job's children existed less than recheck_s ago."""
        with self._lock:
            at = self._seen.get(uid)
        return at is not None and self._clock() - at < self.recheck_s

    def remember(self, uid: str) -> None:
        with self._lock:
            self._seen[uid] = self._clock()

    def remember_if_new(self, uid: str) -> None:
        """Remember a job this process has not seen before (its RayJob exists, and is made last: after a restart,
        all its children were made); one already remembered keeps its time, so that its recheck still comes."""
        with self._lock:
            self._seen.setdefault(uid, self._clock())

    def forget(self, uid: str) -> None:
        with self._lock:
            self._seen.pop(uid, None)
            self._ray_versions.pop(uid, None)

    def derived(self, uid: str, ray_version: str) -> None:
        """The job's status now reflects this resourceVersion of its RayJob."""
        with self._lock:
            self._ray_versions[uid] = ray_version

    def derived_any(self, uid: str) -> bool:
        """A reconcile in this process has derived the job's status from its RayJob."""
        with self._lock:
            return uid in self._ray_versions

    def derived_from(self, uid: str, ray_version: str | None) -> bool:
        with self._lock:
            return ray_version is not None and self._ray_versions.get(uid) == ray_version


class AdapterIndex:
    def __init__(self) -> None:
        self._by_job: defaultdict[tuple[str, str], set[str]] = defaultdict(set)
        self._lock = threading.Lock()

    def seen(self, ns: str, name: str, job: str, gone: bool = False) -> None:
        """An adapter's watch event: `gone` when the API server has deleted it."""
        with self._lock:
            names = self._by_job[(ns, job)]
            if gone:
                names.discard(name)
                if not names:
                    del self._by_job[(ns, job)]
            else:
                names.add(name)

    def of_job(self, ns: str, job: str) -> list[str]:
        with self._lock:
            return sorted(self._by_job.get((ns, job), ()))
