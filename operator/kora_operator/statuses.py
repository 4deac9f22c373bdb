"""Job statuses written behind the reconciles, coalesced per job, by a few background threads (as events.py posts
Events).

In a burst of new jobs every job's status patch competes with every other job's RayJob create for the same API
server and the same two cores, and the API server runs all of the CRD's CEL rules on a /status write too
(bench/crd_cel_cost.py). `StatusWriter` takes the write off that path: a reconcile hands the status it decided
over and goes on; while reconciles run (`busy`) the write is held back, up to `max_delay` seconds after it was
handed over, so that in a burst the children come first. On a quiet operator a status is written at once (as soon
as the reconcile that decided it has ended).

- Coalesced, in order: one pending entry per job. A status handed over while an older one of the same job waits
  is merged into it (the composition of the two merge patches: the newer wins; a reconcile hands over a whole
  status, so that is the newer one), and the entry keeps its place and the time its oldest part was handed over.
  A job has at most one write in flight, so its writes never reorder.
- What the operator decided: `status(...)` is the job's status as the API server returned it with the writes still
  pending or in flight applied on top: what it will be once they are written. A reconcile derives the next status
  and its transitions (one Event per transition, SPEC) from that, never from a status that lags its own decisions.
  After a restart nothing is pending and the API server's status is the truth.
- `then`: what to do once the status is written (the Events of its transitions: they still come after the status
  that shows them); dropped with a status the API server refuses.
- `write_now`: a patch that must be stored before the caller goes on (runtime Ray's rayJobName, written before the
  Ray job is submitted), merged with the job's pending status and written in the caller's thread.
- Bounded: one entry per job; from `capacity` entries on nothing is held back. A write the API server could not
  take (5xx, 429, no answer) is tried again after RETRY_DELAY (merged with anything newer), one it refuses is
  logged and dropped (a 404: the job is gone); the next reconcile derives the status again from the API's.
  `stop` writes what is left (within its timeout) before the operator exits; a SIGKILL loses what waits, and the
  restarted operator handles those jobs again from the API's status (handlers/kopf_state.py).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Gauge

log = logging.getLogger("kora.statuses")

PENDING = Gauge("kora_status_writes_pending", "Job statuses handed over to the status writer and not yet written")
RETRY_DELAY = 1.0  # seconds before a status the API server could not take is tried again
BUSY_POLL = 0.02  # seconds between looks at `busy` while a status is held back

Patch = Callable[[str, str, dict[str, Any]], None]  # (namespace, name, status merge patch)
Key = tuple[str, str]


def compose(older: Mapping[str, Any], newer: Mapping[str, Any]) -> dict[str, Any]:
    """One JSON merge patch (RFC 7386) that does what `older` then `newer` do, for patches whose values keep their
    types (a status: a field that is an object in one is an object in the other)."""
    out = dict(older)
    for k, v in newer.items():
        before = out.get(k)
        out[k] = compose(before, v) if isinstance(v, Mapping) and isinstance(before, Mapping) else v
    return out


def apply(target: Any, patch: Any) -> Any:
    """`target` with the merge patch `patch` applied (RFC 7386), as the API server applies it."""
    if not isinstance(patch, Mapping):
        return patch
    out = dict(target) if isinstance(target, Mapping) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = apply(out.get(k), v)
    return out


@dataclass
class _Entry:
    uid: str | None
    patch: dict[str, Any]
    handed: float  # when its oldest part was handed over
    then: list[Callable[[], None]] = field(default_factory=list)
    not_before: float = 0.0  # a retry's time


class StatusWriter:
    def __init__(self, patch: Patch, busy: Callable[[], bool] = lambda: False, max_delay: float = 5.0,
                 workers: int = 4, capacity: int = 2000) -> None:
        self._patch = patch
        self._busy = busy
        self._max_delay = max_delay
        self._capacity = capacity
        self._pending: OrderedDict[Key, _Entry] = OrderedDict()
        self._writing: dict[Key, _Entry] = {}
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._run, name=f"kora-status-{i}", daemon=True)
                         for i in range(workers)]
        self._started = False
        self._stopping = False
        self._live = 0  # threads taking what is handed over (while stopping too: they write it without holding back)

    def start(self) -> StatusWriter:
        with self._cond:
            self._live = len(self._threads)
        for t in self._threads:
            t.start()
        self._started = True
        return self

    def put(self, ns: str, name: str, uid: str | None, status: Mapping[str, Any],
            then: Callable[[], None] | None = None) -> None:
        """Hand the job's status over (a merge patch of it); `then` runs once it is written. Never waits. Without a
        running writer (not started, or stopped), writes it here and now."""
        key, mine = (ns, name), copy.deepcopy(dict(status))
        with self._cond:
            if self._live:
                entry = self._pending.get(key)
                if entry is not None and entry.uid == uid:
                    entry.patch = compose(entry.patch, mine)
                else:  # none waits, or one of an earlier job of the same name (deleted since): that one is moot
                    entry = self._pending[key] = _Entry(uid, mine, time.monotonic())
                    self._pending.move_to_end(key)
                if then is not None:
                    entry.then.append(then)
                PENDING.set(len(self._pending))
                self._cond.notify()
                return
        self._patch(ns, name, mine)
        if then is not None:
            then()

    def write_now(self, ns: str, name: str, uid: str | None, status: Mapping[str, Any]) -> None:
        """Write the patch `status` before returning, with the job's pending status merged in before it (so the
        job's writes keep their order); raises what the write raised (the pending status then still waits)."""
        key = (ns, name)
        with self._cond:
            while key in self._writing:
                self._cond.wait()
            entry = self._pending.pop(key, None)
            if entry is not None and entry.uid != uid:
                entry = None
            mine = _Entry(uid, compose(entry.patch, status) if entry else dict(status), time.monotonic())
            self._writing[key] = mine
            PENDING.set(len(self._pending))
        try:
            self._patch(ns, name, mine.patch)
        except BaseException:
            with self._cond:
                if entry is not None:
                    self._requeue(key, entry, delay=0.0)
                raise
        else:
            for then in entry.then if entry else ():
                self._then(then)
        finally:
            with self._cond:
                self._writing.pop(key, None)
                self._cond.notify_all()

    def status(self, ns: str, name: str, uid: str | None, api: Mapping[str, Any] | None) -> dict[str, Any]:
        """The job's status as the operator decided it: `api` (as the API server returned it) with the job's writes
        in flight and pending applied."""
        key = (ns, name)
        with self._cond:
            parts = [e.patch for e in (self._writing.get(key), self._pending.get(key))
                     if e is not None and e.uid == uid]
        out = dict(api or {})
        for patch in parts:
            out = apply(out, patch)
        return out

    def forget(self, ns: str, name: str, uid: str | None) -> None:
        """The job is gone: what waits for it is not written."""
        with self._cond:
            entry = self._pending.get((ns, name))
            if entry is not None and (uid is None or entry.uid == uid):
                del self._pending[(ns, name)]
                PENDING.set(len(self._pending))

    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + len(self._writing)

    def stop(self, timeout: float = 10.0) -> None:
        """Write what waits (within `timeout` seconds, holding nothing back), then end the threads; later statuses
        are written directly."""
        if not self._started:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._started = False
        left = self.pending()
        if left:
            log.warning("%d job statuses still waiting at shutdown were not written", left)

    def _run(self) -> None:
        while True:
            with self._cond:
                picked = self._next()
                if picked is None:
                    self._live -= 1
                    return
                key, entry = picked
            try:
                self._patch(key[0], key[1], entry.patch)
            except Exception as e:
                status = getattr(e, "status", None)
                with self._cond:
                    if status is None or status == 429 or status >= 500:
                        log.info("%s/%s: writing the status: %s; trying again", *key, e)
                        self._requeue(key, entry, delay=RETRY_DELAY)
                    elif status != 404:
                        log.warning("%s/%s: the API server refused the status: %s", *key, e)
            else:
                for then in entry.then:
                    self._then(then)
            finally:
                with self._cond:
                    self._writing.pop(key, None)
                    self._cond.notify_all()

    def _next(self) -> tuple[Key, _Entry] | None:
        """Under the lock: wait for the oldest entry that may be written now (none of its job's in flight, its
        retry time come, not held back) and take it; None once stopping and nothing is left."""
        while True:
            now = time.monotonic()
            # the oldest first; in a burst it is the first one (one look, however many wait)
            ready = next(((k, e) for k, e in self._pending.items() if k not in self._writing and e.not_before <= now),
                         None)
            if ready is None:
                if self._stopping and not self._pending:
                    return None
                soon = [e.not_before - now for k, e in self._pending.items() if k not in self._writing]
                self._cond.wait(max(min(soon), 0.001) if soon else None)
                continue
            key, entry = ready
            wait = self._hold_back(entry, now)
            if wait > 0:
                self._cond.wait(wait)
                continue
            del self._pending[key]
            self._writing[key] = entry
            PENDING.set(len(self._pending))
            return key, entry

    def _hold_back(self, entry: _Entry, now: float) -> float:
        """How long to wait before looking again (0: write it now): while reconciles run, until `max_delay` after
        it was handed over; not when stopping, nor from `capacity` entries on."""
        left = self._max_delay - (now - entry.handed)
        if self._stopping or left <= 0 or len(self._pending) >= self._capacity or not self._busy():
            return 0.0
        return min(BUSY_POLL, left)

    def _requeue(self, key: Key, entry: _Entry, delay: float) -> None:
        """Under the lock: put an unwritten entry back first, merged with whatever was handed over since."""
        newer = self._pending.pop(key, None)
        if newer is not None and newer.uid != entry.uid:  # a later job of the same name: this one's status is moot
            self._pending[key] = newer
            return
        if newer is not None:
            entry.patch = compose(entry.patch, newer.patch)
            entry.then.extend(newer.then)
        entry.not_before = time.monotonic() + delay
        self._pending[key] = entry
        self._pending.move_to_end(key, last=False)
        PENDING.set(len(self._pending))
        self._cond.notify()

    @staticmethod
    def _then(then: Callable[[], None]) -> None:
        try:
            then()
        except Exception:  # what follows a write is never worth a writer thread
            log.exception("after writing a status")
