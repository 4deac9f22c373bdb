"""The engine's side of the colocated push handshake (wire/colocated_words.py): a thread per plan that sleeps on
the wake FIFO, reads the shared words, and serves each request the trainer makes there — no HTTP call per push.

- Merge (`MergeHandshake`): request n takes the weight lock (`EngineModel.begin_write`: a generation in flight
  gives way at its next step boundary and recomputes its KV cache after), then GRANT n; the trainer writes the
  merged weights into the mapped memory, synchronises, and stores DONE n (DARG: version, full). The engine marks
  the written names replaced (the new pristine base), sets the version and gives the lock back — in that order,
  so no forward reads half-written weights and a rollout admitted after the lock reports the new version —
  then ACK n. DONE -n gives the lock back unused (the trainer's delta-skip, or a trainer that failed). A trainer
  that does not come back within `lease_s` loses the lock: the weights are taken as torn (`TORN_VERSION`) and
  ACK -n (ERR_TORN), so a late DONE is an error on the trainer's side, not a silent success.
- EngineMerge (`fold_slot` of colocated_routes): request n (ARG: version, slot) folds ring slot `slot` into the
  pristine base under the weight lock, synchronised, the version set before the lock is given back; then ACK n.
  With the plan's `gather` (one trainer rank) the engine first gathers the trainer's adapter into the slot and
  decides the delta-skip against THRESH (colocated_gather.py): a skip folds the previous slot back in, so the
  weights and the version stay the last push's; DELTA and PUSHED say what it found. An ARM for request n has the
  watcher arm it (`Armer`: prelaunch its gather and fold behind the GATE word, or warm them) and spin for it;
  an arm whose request does not come within ARM_S is undone (`disarm`) and SPUN = -n says so.

A handler returns its answer (n, or -n with ERR set) and stores its device time in WORK if it has any; the watcher
stores the time the handler took in SPENT, then the answer in ACK. A handler that raises answers ACK -n
(ERR_FAILED) and logs why; the watcher goes on with the next request.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kora_trainer.wire.colocated_words import (
    ACK,
    ARG,
    ARM,
    ARM_S,
    ARM_SLOT,
    DARG,
    DELTA,
    DONE,
    ERR,
    ERR_FAILED,
    ERR_TORN,
    GRANT,
    LAUNCH_CPU,
    POLL_S,
    PRELAUNCHED,
    PUSHED,
    REQ,
    SPENT,
    SPUN,
    T_ACK,
    T_GATHERED,
    T_LAUNCHED,
    T_LOCKED,
    T_LOCKING,
    T_SEEN,
    T_SYNCED,
    T_WARMED,
    THRESH,
    WARMED,
    WORK,
    Wake,
    Words,
    float_word,
    now_us,
    word_float,
)
from kora_trainer.wire.fast_receive import doorbell_parts

log = logging.getLogger("kora.hf_engine")

TORN_VERSION = "torn"  # the weight version of an engine whose Merge writer never came back


class Armer(NamedTuple):
    """What an armed watcher does ahead of request n (EngineMerge with `gather`): `arm(n, slot)` prelaunches the
    request's work or warms its launch path (colocated_routes.arm_slot), `disarm(n)` undoes an arm that is still
    held: when the request did not come within ARM_S, or its handler failed before taking it."""

    arm: Callable[[int, int], None]
    disarm: Callable[[int], None]


class Watcher:
    """Serves the requests the trainer stores in `words`, one at a time, on a daemon thread of its own."""

    def __init__(self, words: Words, wake: Wake, handle: Callable[[int], int], device: torch.device,
                 armer: Armer | None = None):
        self.words, self.wake, self.handle, self.device, self.armer = words, wake, handle, device, armer
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="kora-colocated-watcher", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.device.type == "cuda" and self.device.index is not None:  # "cuda": the current device already
            torch.cuda.set_device(self.device)  # the fold's stream and the synchronise are the engine's device's
        seen, armed = self.words[REQ], self.words[ARM]
        while not self.stopping:
            n = self.words[REQ]
            if n == seen or n <= 0:
                arm = self.words[ARM]
                if arm != armed and arm > seen:  # request `arm` is coming: wait for it awake (ARM in the words)
                    armed = arm
                    self._spin(arm)
                else:
                    self.wake.wait(POLL_S)
                continue
            if not seen:
                self.wake.unlink()  # the trainer opened it at plan time, before its first request
            seen = n
            self._serve(n)

    def _spin(self, n: int) -> None:
        """Arm for request n on ARM_SLOT (`armer.arm`: prelaunch or warm-up), then read REQ until it is n, for at
        most ARM_S from the arm done (an arm that plans a fold again takes longer than the wait), giving the GIL
        away between reads; a request that did not come is disarmed."""
        if self.armer is not None:
            try:
                self.armer.arm(n, self.words[ARM_SLOT])
            except Exception:  # an arm is never worth a push: the request still comes and is served
                log.exception("the colocated watcher's arm for push %d failed", n)
        self.words[T_WARMED] = now_us()
        self.words[WARMED] = n
        deadline = time.monotonic() + ARM_S
        while self.words[REQ] != n and not self.stopping and time.monotonic() < deadline:
            os.sched_yield()  # the GIL to the engine's other threads; time.sleep(0) would cost ~50-70 µs of timer slack
        if self.words[REQ] == n:
            self.words[SPUN] = n
        else:
            self.words[SPUN] = -n  # ran out: the arm is undone now (its weight lock given back after this store)
            self._disarm(n)

    def _disarm(self, n: int) -> None:
        if self.armer is not None:
            try:
                self.armer.disarm(n)
            except Exception:
                log.exception("the colocated watcher could not disarm push %d", n)

    def _serve(self, n: int) -> None:
        t0 = time.perf_counter()
        for word in (WORK, T_LOCKING, T_LOCKED, T_GATHERED, T_LAUNCHED, T_SYNCED, LAUNCH_CPU):
            self.words[word] = 0
        self.words[T_SEEN] = now_us()
        try:
            ack = self.handle(n)
        except Exception:
            log.exception("the colocated push %d failed on the engine", n)
            self.words[ERR] = ERR_FAILED
            ack = -n
            self._disarm(n)  # an arm the handler did not take (it failed first) gives the lock back
        self.words[SPENT] = round((time.perf_counter() - t0) * 1e6)
        self.words[T_ACK] = now_us()
        self.words[ACK] = ack

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopping = True
        self.wake.poke()
        self.thread.join(timeout_s)
        self.wake.close()


class MergeHandshake:
    """A Merge push's weight lock over the shared words (see the module docstring)."""

    def __init__(self, engine: Any, words: Words, wake: Wake, names: dict[bool, list[str]], lease_s: float,
                 stopping: Callable[[], bool]):
        self.engine, self.words, self.wake, self.names, self.lease_s = engine, words, wake, names, lease_s
        self.stopping = stopping

    def __call__(self, n: int) -> int:
        self.engine.begin_write()  # waits for at most one step of a generation in flight
        try:
            whole = self._window(n)
        finally:
            self.engine.end_write()
        if not whole:
            self.words[ERR] = ERR_TORN
        return n if whole else -n

    def _window(self, n: int) -> bool:
        """Hold the lock for request n until the trainer's DONE; False when its lease ran out (weights torn)."""
        w, engine = self.words, self.engine
        if w[DONE] != -n:  # not withdrawn before the grant
            w[GRANT] = n
            deadline = time.monotonic() + self.lease_s
            while w[DONE] not in (n, -n):
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping():
                    log.error("the colocated Merge writer did not finish push %d within its lease of %g s: the "
                              "weights may be torn", n, self.lease_s)
                    engine.weight_version = TORN_VERSION
                    return False
                self.wake.wait(min(POLL_S, left))
        if w[DONE] == n:
            version, full = doorbell_parts(w[DARG])
            engine.weights_replaced(self.names[bool(full)])  # the trainer synchronised its writes before DONE
            engine.weight_version = str(version)
        return True


Lap = Callable[[str], None]  # fold_slot's marks: "locking", "locked", "gathered", "launched", "synced"
LAPS = {"locking": T_LOCKING, "locked": T_LOCKED, "gathered": T_GATHERED, "launched": T_LAUNCHED, "synced": T_SYNCED}


class Folded(NamedTuple):
    """An EngineMerge fold's outcome: its device time (ms; None off a GPU), whether it stands (False: the delta
    said skip and the last push was folded back), the delta number (None: the trainer decided before asking) and
    whether its gather and fold were enqueued at the request's ARM (colocated_routes.arm_slot)."""

    ms: float | None
    pushed: bool
    delta: float | None
    prelaunched: bool = False


def engine_merge_handshake(words: Words, fold_slot: Callable[..., Folded]) -> Callable[[int], int]:
    """An EngineMerge push: fold the slot the request names (WORK: the fold's device time; T_LOCKED, T_LAUNCHED,
    T_SYNCED and LAUNCH_CPU: where the time around it went), then ACK (see the module docstring). With the plan's
    `gather` the engine gathers the slot first and decides the delta-skip against THRESH: DELTA and PUSHED say
    what it found."""

    def handle(n: int) -> int:
        c0 = time.thread_time()

        def lap(name: str) -> None:
            words[LAPS[name]] = now_us()
            if name == "launched":
                words[LAUNCH_CPU] = round((time.thread_time() - c0) * 1e6)

        version, slot = doorbell_parts(words[ARG])
        done = fold_slot(slot, str(version), lap, word_float(words[THRESH]), request=n)
        if done.prelaunched:
            words[PRELAUNCHED] = n
        if done.ms is not None:
            words[WORK] = round(done.ms * 1000)
        if done.delta is not None:
            words[DELTA] = float_word(done.delta)
        words[PUSHED] = n if done.pushed else -n
        return n

    return handle
