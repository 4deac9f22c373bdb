"""events.py: Events posted behind the reconciles, in order, bounded, flushed at shutdown."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kora_operator import events
from kora_operator.events import EventPoster
from kora_operator.kube import ApiException
from localcluster import wait_for


def event(i: int) -> dict[str, Any]:
    return {"reason": f"R{i}", "involvedObject": {"name": f"job-{i % 3}"}}


class Recorder:
    def __init__(self, gate: threading.Event | None = None, fail: dict[str, list[int]] | None = None) -> None:
        self.posted: list[str] = []
        self.gate = gate
        self.fail = fail or {}  # reason -> statuses to raise, one per attempt
        self.lock = threading.Lock()

    def __call__(self, ns: str, body: dict[str, Any]) -> None:
        if self.gate is not None:
            assert self.gate.wait(10)
        statuses = self.fail.get(body["reason"])
        if statuses:
            raise ApiException(status=statuses.pop(0), reason="refused")
        with self.lock:
            self.posted.append(body["reason"])


def test_events_are_posted_in_the_order_they_were_handed_over_and_stop_posts_what_waits():
    gate = threading.Event()
    rec = Recorder(gate)
    poster = EventPoster(rec).start()
    for i in range(50):
        poster.put("ns", event(i))  # returns at once: nothing is posted while the gate is shut
    assert rec.posted == []
    gate.set()
    poster.stop(timeout=10)
    assert rec.posted == [f"R{i}" for i in range(50)]
    assert poster.pending() == 0
    poster.put("ns", event(99))  # after stop: posted here and now
    assert rec.posted[-1] == "R99"


def test_handing_over_waits_for_room_when_capacity_events_wait():
    gate = threading.Event()
    rec = Recorder(gate)
    poster = EventPoster(rec, capacity=2).start()
    for i in range(3):  # one being posted (held at the gate), two waiting
        poster.put("ns", event(i))
    fourth = threading.Thread(target=poster.put, args=("ns", event(3)))
    fourth.start()
    fourth.join(0.3)
    assert fourth.is_alive()  # no room: it waits, as posting it would have
    gate.set()
    fourth.join(10)
    assert not fourth.is_alive()
    poster.stop(timeout=10)
    assert rec.posted == ["R0", "R1", "R2", "R3"]


def test_a_poster_never_started_posts_at_once():
    rec = Recorder()
    EventPoster(rec).put("ns", event(1))
    assert rec.posted == ["R1"]


def test_a_refused_event_is_dropped_and_one_the_api_server_could_not_take_is_tried_again(monkeypatch):
    monkeypatch.setattr(events, "RETRY_DELAY", 0.0)
    rec = Recorder(fail={"R0": [422], "R1": [503], "R2": [500, 500]})
    poster = EventPoster(rec).start()
    for i in range(4):
        poster.put("ns", event(i))
    poster.stop(timeout=10)
    assert rec.posted == ["R1", "R3"]  # R0 refused, R1 taken at its retry, R2 failed twice; the order kept


@pytest.mark.parametrize("capacity", [1, 3])
def test_the_queued_gauge_counts_what_is_not_posted_yet(capacity):
    gate = threading.Event()
    poster = EventPoster(Recorder(gate), capacity=capacity).start()
    before = events.QUEUED._value.get()
    poster.put("ns", event(0))
    assert events.QUEUED._value.get() == before + 1  # being posted still counts
    gate.set()
    poster.stop(timeout=10)
    assert events.QUEUED._value.get() == before


def test_events_wait_while_reconciles_run_up_to_the_most_delay(monkeypatch):
    monkeypatch.setattr(events, "BUSY_POLL", 0.01)
    busy = threading.Event()
    busy.set()
    rec = Recorder()
    poster = EventPoster(rec, busy=busy.is_set, max_delay=30.0).start()
    poster.put("ns", event(0))
    poster.put("ns", event(1))
    threading.Event().wait(0.2)  # a while, to see nothing happen in it
    assert rec.posted == []  # held back while reconciles run
    busy.clear()
    poster.stop(timeout=10)
    assert rec.posted == ["R0", "R1"]
    # never longer than max_delay, and never once the queue is half full
    busy.set()
    late = Recorder()
    poster = EventPoster(late, busy=busy.is_set, max_delay=0.1).start()
    poster.put("ns", event(2))
    wait_for(lambda: late.posted == ["R2"], timeout=10, interval=0.01, what="the late Event")
    full = Recorder()
    poster = EventPoster(full, capacity=4, busy=busy.is_set, max_delay=30.0).start()
    for i in range(4):
        poster.put("ns", event(i))
    wait_for(lambda: full.posted[:2] == ["R0", "R1"], timeout=10, interval=0.01, what="the first two")
    poster.stop(timeout=10)
    assert full.posted == ["R0", "R1", "R2", "R3"]

