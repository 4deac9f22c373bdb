"""The rollout manager's registry of prefixed rids in flight (orchestration/inflight_rids.py) and its exact-rid abort
of one prefix (rollout_manager.Rollout.abort_prefix): what a multi-adapter retire runs on a stock SGLang build, which
has no abort by rid prefix. Engines are fakes that record the aborts; the strict engines' side is in
test_sglang_build_strict_engine.py, the whole retire in tests/e2e/test_multi_lora_stock_build.py."""

from __future__ import annotations

import threading

from kora_trainer.orchestration.inflight_rids import InFlightRids
from kora_trainer.orchestration.rollout_manager import Rollout, not_sent


def test_rids_are_held_while_their_call_runs_and_a_closed_prefix_sends_nothing():
    r = InFlightRids()
    with r.sent("a::", 0, ["a::1", "a::2"]) as ok, r.sent("b::", 1, ["b::1"]):
        assert ok and r.held("a::") == {0: ["a::1", "a::2"]} and r.held("b::") == {1: ["b::1"]}
        assert r.close("a::") == {0: ["a::1", "a::2"]}
        with r.sent("a::", 1, ["a::3"]) as late:  # a call of a closed prefix: not sent, not held
            assert not late and r.held("a::") == {0: ["a::1", "a::2"]}
    assert r.held("a::") == {} and r.held("b::") == {} and r.is_closed("a::")
    r.open("a::")  # the name registered again
    with r.sent("a::", 0, ["a::4"]) as ok:
        assert ok


class FakeClient:
    """Records /abort_request calls; the first abort of each rid arrives before its /generate did (dropped by the
    engine, as SGLang drops an unknown rid), the second ends the call."""

    def __init__(self, done: threading.Event):
        self.aborts: list[str] = []
        self.done = done

    def abort_request(self, rid: str, prefix: bool = False) -> None:
        assert not prefix  # exact rids only
        self.aborts.append(rid)
        if self.aborts.count(rid) == 2:
            self.done.set()


def test_abort_prefix_aborts_each_rid_exactly_on_its_engine_until_its_call_returned():
    rollout = Rollout.__new__(Rollout)  # only the fields abort_prefix reads
    rollout.rids, rollout.urls = InFlightRids(), ["http://e0", "http://e1"]
    done = threading.Event()
    rollout.clients = [FakeClient(done), FakeClient(done)]
    entered = threading.Event()

    def call() -> None:  # a /generate of adapter a on engine 1, returning once aborted
        with rollout.rids.sent("a::", 1, ["a::x"]):
            entered.set()
            done.wait(10)

    t = threading.Thread(target=call)
    t.start()
    entered.wait(10)
    with rollout.rids.sent("b::", 0, ["b::y"]):  # another adapter's call: untouched
        out = rollout.abort_prefix("a::", wait_s=10)
    t.join(10)
    assert out["aborted"] == 1 and out["in_flight_left"] == {"http://e0": 0, "http://e1": 0}, out
    assert rollout.clients[0].aborts == [] and rollout.clients[1].aborts == ["a::x", "a::x"]
    assert not_sent("a::").finish_reason["type"] == "abort"  # what a call of the closed prefix answers


def test_abort_prefix_is_bounded_and_says_what_is_left():
    rollout = Rollout.__new__(Rollout)
    rollout.rids, rollout.urls = InFlightRids(), ["http://e0"]
    rollout.clients = [FakeClient(threading.Event())]
    with rollout.rids.sent("a::", 0, ["a::x"]):  # a call that never returns within the wait
        out = rollout.abort_prefix("a::", wait_s=0.2)
    assert out["aborted"] == 1 and out["in_flight_left"] == {"http://e0": 1}, out
