"""The poll loop: watched jobs are polled every interval, one poll per job at a time."""

from __future__ import annotations

import threading
import time

import kopf

from kora_operator.handlers.poller import Poller
from localcluster import wait_for


def _polls_of_one_since(calls: list[tuple[str, str]], mark: int) -> int:
    return calls[mark:].count(("a", "one"))


def test_watched_jobs_are_polled_and_unwatched_ones_are_not():
    calls: list[tuple[str, str]] = []
    # one worker: polls run one after another in the order they were handed out
    p = Poller(0.05, lambda ns, name: calls.append((ns, name)), workers=1).start()
    try:
        p.watch("a", "one")
        p.watch("a", "two")
        wait_for(lambda: {("a", "one"), ("a", "two")} <= set(calls), timeout=5, what="both polled")
        p.unwatch("a", "two")
        mark = len(calls)
        # one poll of a job is out at a time, so the 2nd poll of "one" after `mark` was handed out after the
        # unwatch; with one worker, every poll handed out before it ("two" included) has run by then
        wait_for(lambda: _polls_of_one_since(calls, mark) >= 2, timeout=5, interval=0.01,
                 what="a poll already handed out to finish")
        n, mark = calls.count(("a", "two")), len(calls)
        wait_for(lambda: _polls_of_one_since(calls, mark) >= 3, timeout=5, interval=0.01,
                 what="three more rounds that would have polled two")
        assert calls.count(("a", "two")) == n and p.watched() == {("a", "one")}
    finally:
        p.stop()


def test_a_slow_poll_is_not_piled_up_and_errors_do_not_stop_the_loop():
    running, most = [0], [0]
    lock = threading.Lock()
    done = threading.Event()

    def poll(ns, name):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        done.set()
        if name == "bad":
            raise kopf.TemporaryError("flaky")
        raise RuntimeError("boom")

    p = Poller(0.02, poll).start()
    try:
        p.watch("a", "bad")
        assert done.wait(5)
        done.clear()
        assert done.wait(5)  # polled again after raising
        assert most[0] == 1
    finally:
        p.stop()
