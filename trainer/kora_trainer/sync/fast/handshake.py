"""The push handshake of the colocated fast path (Merge, EngineMerge): each engine's words in shared memory and its
wake FIFO (wire/colocated_words.py says what every word means), requests numbered n and answered by ACK n. Every
wait is bounded by the transport's timeout: a SyncError naming the engine and the word it did not write, never a
hang. Also the clock of a push (`Laps`) and engine 0's account of an EngineMerge push (`engine_laps`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kora_trainer.sync.transport import SyncError, wait_all
from kora_trainer.wire.colocated_words import (
    ACK,
    ARM,
    ARM_SLOT,
    ERR,
    ERRORS,
    LAUNCH_CPU,
    PRELAUNCHED,
    SPUN,
    T_ACK,
    T_GATHERED,
    T_LAUNCHED,
    T_LOCKED,
    T_LOCKING,
    T_SEEN,
    T_SYNCED,
    T_WARMED,
    WARMED,
    Waker,
    Words,
    wait_word,
)


class Laps:
    """Where this push's time went: the phases (ms), each closed by `lap` (ms since the previous one)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.t = 0.0

    def start(self) -> float:
        self.laps = {}
        self.t = time.perf_counter()
        return self.t

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round((now - self.t) * 1000, 3)
        self.t = now




def ask_all(transport: Any, step: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One `/kora/colocated/<step>` call per engine, in parallel; every answer (the first failure raised)."""
    clients = transport.clients
    return wait_all([c.submit(c.colocated, step, b) for c, b in zip(clients, bodies, strict=True)],
                    transport.timeout_s)


class Handshake:
    """Each engine's handshake words (CPU, shared) and wake FIFO, and the requests made through them."""

    def __init__(self, transport: Any, mode: Any):
        self.transport, self.mode = transport, mode
        self.words: list[Words] = []
        self.wakers: list[Waker] = []
        self.seq = 0  # the last request made through the handshake
        self.answered = 0  # ... and the last one every engine answered

    def attach(self, answers: list[dict[str, Any]], mapped: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Each engine's handshake words (taken out of its mapped tensors) and wake FIFO."""
        for answer, named in zip(answers, mapped, strict=True):
            words = dict(named).get("handshake")
            if words is None:
                raise ValueError("the engine hands over no push handshake (wire/colocated_words.py)")
            self.words.append(Words(words))
            self.wakers.append(Waker(answer.get("wake")))
            named[:] = [(n, t) for n, t in named if n != "handshake"]

    def close(self) -> None:
        for waker in self.wakers:
            waker.close()
        self.words, self.wakers = [], []

    def wake(self) -> None:
        for wake in self.wakers:
            wake()

    def next(self) -> int:
        """The next request's number (made once every engine answered the one before: `settled`)."""
        self.settled()
        self.seq += 1
        return self.seq

    def arm(self, slot: int) -> None:
        """ARM the next request with the ring slot it will name (wire/colocated_words.py)."""
        for words in self.words:
            words[ARM_SLOT] = slot
            words[ARM] = self.seq + 1
        self.wake()

    def store(self, arg_word: int, arg: int, word: int, value: int) -> None:
        """Every engine: `arg` into `arg_word`, then `value` into `word` (what publishes it), then its wake."""
        for words in self.words:
            words[arg_word] = arg
            words[word] = value
        self.wake()

    def wait(self, word: int, accept: Callable[[int], bool], what: str) -> list[int]:
        """Each engine's `word` once `accept`ed, bounded by the transport's timeout."""
        got = []
        for c, words in zip(self.transport.clients, self.words, strict=True):
            try:
                got.append(wait_word(words, word, accept, self.transport.timeout_s, f"{c.base_url} {what}"))
            except TimeoutError as e:
                raise SyncError(f"colocated {self.mode} push: {e} (the engine's handshake watcher is gone or "
                                f"stuck; sync.transportTimeoutS bounds the wait)") from None
        return got

    def settled(self) -> None:
        """A request is made only once every engine answered the one before (after a timeout the engine may
        still be working on it: reading the ring slot, holding its lock)."""
        n = self.seq
        if self.words and self.answered != n:
            self.acks(n, "still unanswered from a push that timed out")

    def acks(self, n: int, what: str) -> None:
        acks = self.wait(ACK, lambda v: v in (n, -n), f"did not acknowledge push {n} ({what})")
        self.answered = n
        refused = [f"{c.base_url}: {ERRORS.get(words[ERR], 'refused')}" for c, words, a in
                   zip(self.transport.clients, self.words, acks, strict=True) if a == -n]
        if refused:
            raise SyncError(f"colocated {self.mode} push {n} ({what}) refused by {'; '.join(refused)}")


def engine_laps(w: Words, laps: dict[str, float], asked: int, answered: int, n: int) -> None:
    """Engine 0's EngineMerge push, moment by moment (the T_ words, one clock for both processes): from the
    request's store to its watcher reading it (`engine_wake`), its weight lock held (`engine_lock`), the fold
    enqueued (`engine_launch`, of which `engine_launch_cpu` the thread's CPU), done on the device
    (`engine_wait`), the ACK stored (`engine_after`), and the ACK seen here (`ack_notice`). Inside those:
    `engine_prelude`, the handler's own work before it asks for the lock (of `engine_lock`), and
    `engine_gather_launch`, the lock held to the gather enqueued (of `engine_launch`, with `gather`). An armed
    push (`arm`) adds `engine_warmed_ahead`, how long before the request the engine's warm-up (or prelaunch)
    was done, `engine_spun`, 1 when the request found the watcher spinning rather than asleep, and
    `engine_prelaunched`, 1 when its gather and fold were enqueued at the arm behind GATE (then the lock and
    the launch marks are the request's reading: they happened before it)."""
    marks = [asked, w[T_SEEN], w[T_LOCKED], w[T_LAUNCHED], w[T_SYNCED], w[T_ACK], answered]
    if not all(marks):
        return
    names = ["engine_wake", "engine_lock", "engine_launch", "engine_wait", "engine_after", "ack_notice"]
    for name, a, b in zip(names, marks, marks[1:], strict=False):
        laps[name] = (b - a) / 1000
    laps["engine_launch_cpu"] = w[LAUNCH_CPU] / 1000
    if w[T_LOCKING]:
        laps["engine_prelude"] = (w[T_LOCKING] - w[T_SEEN]) / 1000
    if w[T_GATHERED]:
        laps["engine_gather_launch"] = (w[T_GATHERED] - w[T_LOCKED]) / 1000
    if w[WARMED] == n:
        laps["engine_warmed_ahead"] = (asked - w[T_WARMED]) / 1000
        laps["engine_spun"] = float(w[SPUN] == n)
        laps["engine_prelaunched"] = float(w[PRELAUNCHED] == n)
