"""Events posted behind the reconciles, in order, by one background thread (kopf's own `kopf.event` posts through
a queue the same way).

A user reads Events (`kubectl describe`) but waits on none of them; a reconcile waits on its children and its
status. Under a burst every API round trip competes for the same API server and the same two cores, so a
reconcile that posted its Events itself held up every other job's children by as many writes
(bench/operator_scale.py: three of a new job's ten). `EventPoster` takes them off that path: a reconcile hands
each Event over and goes on; the poster posts them one at a time, in the order they were handed over (so a job's
Events keep their order), and while reconciles run (`busy`) it holds them back, up to `max_delay` seconds after
each was handed over, so that in a burst every job's children and status come first. On a quiet operator an Event
is posted at once.

Bounded: when `capacity` Events wait, handing one more over waits for room (as posting it did), so memory stays
bounded and no Event is dropped for being late; from half full on nothing is held back. `stop` posts what is left
(within its timeout) before the operator exits. An Event the API server refuses is logged and dropped, and one it
could not take (5xx, 429, no answer) is tried once more: Events are best effort, as they were when a reconcile's own
post failed and its retry found nothing left to say.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Gauge

log = logging.getLogger("kora.events")

QUEUED = Gauge("kora_events_queued", "Events handed over to the poster and not yet posted (or dropped)")
RETRY_DELAY = 1.0  # seconds before the one retry of an Event the API server could not take
BUSY_POLL = 0.05  # seconds between looks at `busy` while an Event is held back

Post = Callable[[str, dict[str, Any]], None]  # (namespace, Event body)
_STOP = object()


class EventPoster:
    def __init__(self, post: Post, capacity: int = 2000, busy: Callable[[], bool] = lambda: False,
                 max_delay: float = 10.0) -> None:
        self._post = post
        self._capacity = capacity
        self._busy = busy
        self._max_delay = max_delay
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._run, name="kora-events", daemon=True)
        self._started = False
        self._stopping = threading.Event()

    def start(self) -> EventPoster:
        self._thread.start()
        self._started = True
        return self

    def put(self, ns: str, body: dict[str, Any]) -> None:
        """Hand one Event over; waits only while `capacity` others wait. Without a running poster (not started,
        or stopped), posts it here and now."""
        if not self._started or not self._thread.is_alive():
            self._post(ns, body)
            return
        QUEUED.inc()
        self._queue.put((time.monotonic(), ns, body))

    def pending(self) -> int:
        return self._queue.qsize()

    def stop(self, timeout: float = 10.0) -> None:
        """Post what waits (for at most `timeout` seconds, holding nothing back), then end the thread; later Events
        are posted directly."""
        if not self._started:
            return
        self._stopping.set()
        try:
            self._queue.put(_STOP, timeout=timeout)
            self._thread.join(timeout)
        except queue.Full:
            pass
        self._started = False
        if self._thread.is_alive():
            log.warning("%d Events still waiting at shutdown were not posted", self._queue.qsize())

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            handed, ns, body = item
            self._hold_back(handed)
            try:
                self._post_once(ns, body, retry=True)
            finally:
                QUEUED.dec()

    def _hold_back(self, handed: float) -> None:
        """Wait while reconciles run, until `max_delay` after the Event was handed over; not when stopping, nor
        while the queue is half full or more (the reconciles would soon wait on it)."""
        while (self._busy() and not self._stopping.is_set() and self._queue.qsize() < self._capacity // 2
               and time.monotonic() - handed < self._max_delay):
            self._stopping.wait(BUSY_POLL)

    def _post_once(self, ns: str, body: dict[str, Any], retry: bool) -> None:
        try:
            self._post(ns, body)
        except Exception as e:  # an Event is never worth the poster thread
            status = getattr(e, "status", None)
            if retry and (status is None or status == 429 or status >= 500):
                time.sleep(RETRY_DELAY)  # the poster's own thread: no handler waits on it
                self._post_once(ns, body, retry=False)
                return
            log.warning("could not post Event %s on %s/%s: %s", body.get("reason"), ns,
                        (body.get("involvedObject") or {}).get("name"), e)
