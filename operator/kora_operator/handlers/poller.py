"""The poll loop: every `interval` seconds, reconcile each job that has something outside Kubernetes
to look at (a running trainer's /status; a runtime-Ray job's state in the Ray Jobs API).

Not a kopf timer on purpose: kopf puts a finalizer on every object a timer serves, so a KubeRay job
could not be deleted while the operator is down. The set of watched jobs is in memory; reconcile
keeps it (after a restart every job is reconciled again, by kopf's resume handler or its RayJob's event from
kopf's first listing, which fills it again).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import kopf

log = logging.getLogger("kora.poller")
Key = tuple[str, str]


class Poller:
    def __init__(self, interval: float, poll: Callable[[str, str], object], workers: int = 4) -> None:
        self.interval = interval
        self._poll = poll
        self._keys: set[Key] = set()
        self._busy: set[Key] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kora-poll")
        self._thread = threading.Thread(target=self._loop, name="kora-poller", daemon=True)

    def watch(self, ns: str, name: str) -> None:
        with self._lock:
            self._keys.add((ns, name))

    def unwatch(self, ns: str, name: str) -> None:
        with self._lock:
            self._keys.discard((ns, name))

    def watched(self) -> set[Key]:
        with self._lock:
            return set(self._keys)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                due = self._keys - self._busy  # a slow poll of one job is not piled up on
                self._busy |= due
            for key in due:
                self._pool.submit(self._run, key)

    def _run(self, key: Key) -> None:
        try:
            self._poll(*key)
        except kopf.TemporaryError as e:
            log.info("%s/%s: poll: %s", *key, e)
        except Exception:
            log.exception("%s/%s: poll failed", *key)
        finally:
            with self._lock:
                self._busy.discard(key)
