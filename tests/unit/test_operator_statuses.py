"""statuses.py: job statuses written behind the reconciles, coalesced per job, in order, bounded, flushed at
shutdown; and what a reconcile reads back meanwhile."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kora_operator import statuses
from kora_operator.kube import ApiException
from kora_operator.statuses import StatusWriter, apply, compose
from localcluster import wait_for


class Recorder:
    """The API server's /status: applies each merge patch, records (job, patch) in the order written."""

    def __init__(self, gate: threading.Event | None = None, fail: dict[str, list[int]] | None = None) -> None:
        self.written: list[tuple[str, dict[str, Any]]] = []
        self.stored: dict[str, dict[str, Any]] = {}
        self.gate = gate
        self.fail = fail or {}  # job name -> statuses to raise, one per attempt
        self.lock = threading.Lock()
        self.entered = threading.Event()  # a write has begun

    def __call__(self, ns: str, name: str, patch: dict[str, Any]) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        codes = self.fail.get(name)
        if codes:
            raise ApiException(status=codes.pop(0), reason="refused")
        with self.lock:
            self.written.append((name, patch))
            self.stored[name] = apply(self.stored.get(name) or {}, patch)

    def names(self) -> list[str]:
        with self.lock:
            return [n for n, _ in self.written]


def reconciles_running() -> threading.Event:
    """What the writer's `busy` looks at: set while reconciles run (here: from the start)."""
    busy = threading.Event()
    busy.set()
    return busy


def test_merge_patches_compose_as_applied_one_after_the_other():
    base = {"phase": "Pending", "conditions": [{"type": "Validated"}], "progress": {"step": 1, "total": 9}}
    a = {"phase": "Running", "progress": {"step": 2}, "rayJobName": "x"}
    b = {"progress": {"step": 3, "eta": "1m"}, "rayJobName": None, "restarts": 1}
    assert apply(apply(base, a), b) == apply(base, compose(a, b)) == {
        "phase": "Running", "conditions": [{"type": "Validated"}], "progress": {"step": 3, "total": 9, "eta": "1m"},
        "restarts": 1}
    assert apply(apply(base, a), compose(a, b)) == apply(base, compose(a, b))  # a part already written: the same


def test_a_jobs_newer_status_replaces_its_pending_one_and_the_jobs_keep_their_order():
    gate = threading.Event()
    rec = Recorder(gate)
    writer = StatusWriter(rec, workers=1).start()
    writer.put("ns", "first", "u0", {"phase": "Pending"})  # taken at once, held at the gate
    assert rec.entered.wait(10)  # the first write in flight
    assert writer.status("ns", "first", "u0", None) == {"phase": "Pending"}  # what it will be once written
    done: list[str] = []
    for i, phase in enumerate(["Pending", "Provisioning", "Running"]):
        writer.put("ns", "a", "ua", {"phase": phase, "progress": {"step": i}}, then=lambda p=phase: done.append(p))
        writer.put("ns", "b", "ub", {"phase": phase})
    writer.put("ns", "first", "u0", {"phase": "Running"})  # waits behind its own write in flight
    assert writer.pending() == 4  # one entry a job (and one in flight)
    # what a reconcile reads back meanwhile: the API's status with the writes not made yet on top
    assert writer.status("ns", "a", "ua", {"phase": "Pending", "startTime": "t"}) == {
        "phase": "Running", "progress": {"step": 2}, "startTime": "t"}
    assert writer.status("ns", "a", "another-uid", {"phase": "Pending"}) == {"phase": "Pending"}
    gate.set()
    writer.stop(timeout=10)
    assert rec.names() == ["first", "a", "b", "first"]  # each job once more, in the order first handed over
    assert rec.stored == {"first": {"phase": "Running"}, "a": {"phase": "Running", "progress": {"step": 2}},
                          "b": {"phase": "Running"}}
    assert done == ["Pending", "Provisioning", "Running"]  # every coalesced write's follow-up, in order, once written
    assert writer.pending() == 0 and writer.status("ns", "a", "ua", {"phase": "X"}) == {"phase": "X"}
    writer.put("ns", "c", "uc", {"phase": "Failed"})  # after stop: written here and now
    assert rec.stored["c"] == {"phase": "Failed"}


def test_statuses_are_held_back_while_reconciles_run_up_to_the_most_delay(monkeypatch):
    monkeypatch.setattr(statuses, "BUSY_POLL", 0.01)
    busy = reconciles_running()
    rec = Recorder()
    writer = StatusWriter(rec, busy=busy.is_set, max_delay=30.0).start()
    writer.put("ns", "a", "ua", {"phase": "Pending"})
    threading.Event().wait(0.2)  # a while, to see nothing happen in it
    assert rec.written == []  # held back while reconciles run
    busy.clear()  # nothing runs: written at once
    wait_for(lambda: rec.names() == ["a"], timeout=10, interval=0.01, what="the status once idle")
    writer.stop(timeout=10)
    # never longer than max_delay after it was handed over
    late = Recorder()
    busy.set()
    writer = StatusWriter(late, busy=busy.is_set, max_delay=0.1).start()
    writer.put("ns", "a", "ua", {"phase": "Pending"})
    wait_for(lambda: late.names() == ["a"], timeout=10, interval=0.01, what="the late status")
    writer.stop(timeout=10)
    # nothing is held back from `capacity` waiting jobs on, nor at stop
    full = Recorder()
    writer = StatusWriter(full, busy=busy.is_set, max_delay=30.0, capacity=3).start()
    for job in "abc":
        writer.put("ns", job, "u" + job, {"phase": "Pending"})
    wait_for(lambda: "a" in full.names(), timeout=10, interval=0.01, what="a write from a full writer")
    writer.put("ns", "d", "ud", {"phase": "Pending"})
    writer.stop(timeout=10)  # busy still: stop writes what waits all the same
    assert sorted(full.names()) == ["a", "b", "c", "d"]


def test_a_write_now_goes_after_the_jobs_pending_status_in_one_write():
    busy = reconciles_running()
    rec = Recorder()
    writer = StatusWriter(rec, busy=busy.is_set, max_delay=30.0).start()
    writer.put("ns", "a", "ua", {"phase": "Pending", "rayJobName": "a-1", "restarts": 0})
    writer.write_now("ns", "a", "ua", {"rayJobName": "a-2", "restarts": 1})  # before a resubmission
    assert rec.written == [("a", {"phase": "Pending", "rayJobName": "a-2", "restarts": 1})]
    assert writer.pending() == 0
    # a failed one raises, and the pending status still waits
    rec.fail["a"] = [503]
    writer.put("ns", "a", "ua", {"phase": "Running"})
    with pytest.raises(ApiException):
        writer.write_now("ns", "a", "ua", {"rayJobName": "a-3"})
    assert writer.status("ns", "a", "ua", rec.stored["a"])["phase"] == "Running"
    assert writer.status("ns", "a", "ua", rec.stored["a"])["rayJobName"] == "a-2"
    writer.stop(timeout=10)
    assert rec.stored["a"] == {"phase": "Running", "rayJobName": "a-2", "restarts": 1}


def test_a_status_the_api_server_could_not_take_is_written_again_and_a_refused_or_forgotten_one_dropped(
        monkeypatch):
    monkeypatch.setattr(statuses, "RETRY_DELAY", 0.0)
    rec = Recorder(fail={"retried": [503, 429], "refused": [422], "gone": [404]})
    writer = StatusWriter(rec, workers=1).start()
    after: list[str] = []
    for job in ("retried", "refused", "gone"):
        writer.put("ns", job, "u", {"phase": "Pending"}, then=lambda j=job: after.append(j))
    writer.stop(timeout=10)
    assert rec.stored == {"retried": {"phase": "Pending"}}
    assert after == ["retried"]  # a refused status's Events are not posted
    # a job deleted (its DELETED event) or made again under the same name: its old status is not written
    busy = reconciles_running()
    rec = Recorder()
    writer = StatusWriter(rec, busy=busy.is_set, max_delay=30.0).start()
    writer.put("ns", "a", "old", {"phase": "Running"})
    writer.forget("ns", "a", "old")
    writer.put("ns", "b", "old", {"phase": "Running", "restarts": 2})
    writer.put("ns", "b", "new", {"phase": "Pending"})
    writer.stop(timeout=10)
    assert rec.written == [("b", {"phase": "Pending"})]


def test_the_pending_gauge_counts_the_jobs_waiting():
    gate = threading.Event()
    writer = StatusWriter(Recorder(gate), workers=1).start()
    writer.put("ns", "a", "ua", {"phase": "Pending"})
    writer.put("ns", "b", "ub", {"phase": "Pending"})
    wait_for(lambda: statuses.PENDING._value.get() == 1, timeout=10, interval=0.01, what="one taken, one waiting")
    gate.set()
    writer.stop(timeout=10)
    assert statuses.PENDING._value.get() == 0
