"""The colocated fast path's per-push handshake in shared memory (issue 17): what a Merge or EngineMerge push
says to the engine beside it instead of HTTP calls. The trainer's side is sync/fast/colocated.py, the engine's
kora_engine/lm/colocated_watcher.py; the Adapter doorbell (fast_receive.doorbell_value) is the one-word case.

The words: int64 [NWORDS] in CPU shared memory, made by the engine at plan time and handed over with the memory
the trainer writes (`serialize.serialize_payload` shares a CPU tensor's storage). Each word has one writer:

    REQ    trainer  n, the push's sequence number (1, 2, ...): a request, written after its ARG
    ARG    trainer  EngineMerge: doorbell_value(version, slot) of request n
    GRANT  engine   Merge: n once the engine holds its weight lock for request n
    DONE   trainer  Merge: n once the write of request n is whole on the device, -n to give the lock back unused
    DARG   trainer  Merge: doorbell_value(version, 1 if the write was full else 0), written before DONE
    ACK    engine   n once request n is served (version set, lock given back); -n when it was refused
    ERR    engine   why request -ACK was refused: ERR_TORN (the write did not finish within the lease) or
                    ERR_FAILED (the engine's log says what)
    SPENT  engine   microseconds the engine spent on request ACK, from reading REQ to storing ACK (written
                    before ACK): the trainer's report splits a push's time into the engine's part and the rest
    WORK   engine   microseconds of device time of the engine's own work on request ACK (EngineMerge: the
                    fold, by CUDA events; 0 where there is none or no GPU), written before ACK: what of SPENT
                    is the fold and what is waking, locking, launching and synchronising
    T_SEEN, T_LOCKED, T_LAUNCHED, T_SYNCED, T_ACK  engine  request ACK's moments on CLOCK_MONOTONIC (µs; one clock
                    for every process of the host): REQ read, weight lock held, fold enqueued, fold done on the
                    device, ACK about to be stored (the last four EngineMerge's; 0 where not reached)
    THRESH trainer  EngineMerge with the plan's `gather`: request n's delta-skip threshold (`float_word`),
                    written before REQ: the engine gathers the trainer's adapter and decides (colocated_gather.py)
    DELTA  engine   ... then request ACK's max |now - last pushed| (`float_word`), written before ACK
    T_LOCKING, T_GATHERED  engine  moments inside EngineMerge's lock and launch (0 where not reached): about to take
                    the weight lock (after the handler's own preparation), and the gather enqueued (with `gather`)
    PUSHED engine   ... and n when request n's fold stands, -n when the delta said skip (the engine folded the
                    last push back in: weights and version unchanged), written before ACK
    ARM    trainer  n once its step's update is done, before request n (EngineMerge with `gather`), after
                    ARM_SLOT (the ring slot request n will name): the watcher wakes, replays that slot's gather
                    once (the slot is scratch until request n rewrites it) and spins for REQ n, at most ARM_S, so
                    the request finds its thread running and its launch path warm rather than asleep in `select`
                    (a push's critical path); an arm with no request after it costs the engine ARM_S of one
                    core and one gather (~0.03 ms of device time). The arm also takes the engine's weight lock
                    when it is free (a generation admitted meanwhile waits, at most ARM_S), and on a GPU enqueues
                    the request's work instead of warming it (see GATE): an arm with no request after it then
                    also holds one SM's slot for ARM_S and costs two folds
    WARMED, T_WARMED  engine  n and the moment (µs) the warm-up (or the prelaunch) for armed request n was done
    SPUN   engine   n when the watcher saw request n while spinning for it (not woken from `select`); -n when
                    it spun ARM_S for armed request n in vain, stored before it undoes the arm
    GATE   trainer  n with request n (EngineMerge with `gather`), after its synchronise and before THRESH, ARG and
                    REQ: an armed engine on a GPU (kora_engine/lm/word_gate.py) has enqueued request n's gather
                    and fold under its weight lock behind a kernel that spins until GATE >= n, and this store
                    starts them; the engine stores it itself to cancel an arm whose request did not come within
                    ARM_S (the one word with two writers: both store n)
    PRELAUNCHED engine n when request n's gather and fold were enqueued at its ARM (only their end was on the
                    push's path), written before ACK
    LAUNCH_CPU engine the watcher thread's CPU time (µs) from reading REQ to the fold enqueued: far below
                    T_LAUNCHED - T_SEEN, the thread was waiting (for the GIL, a core) rather than working
A word is one aligned 8-byte store and one 8-byte load; a reader takes a word only after the word that
publishes it (ARG before REQ, DARG before DONE), which stores in program order keep on x86 (TSO).

Waking: the engine's watcher sleeps in `select` on a FIFO (`Wake`), so it costs nothing while idle and sees a
request within microseconds: the trainer writes one byte after each word the engine waits for (`Waker`). The
watcher also reads the words every `POLL_S`, so a lost wake (a full pipe, no FIFO) only delays, never hangs.
The trainer waits for the engine's words with `wait_word`: bounded, a clear error naming what timed out.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import tempfile
import time
import uuid
from collections.abc import Callable

import torch

REQ, ARG, GRANT, DONE, DARG, ACK, ERR, SPENT, WORK = range(9)
T_SEEN, T_LOCKED, T_LAUNCHED, T_SYNCED, T_ACK, LAUNCH_CPU = range(9, 15)
THRESH, DELTA, PUSHED = 15, 16, 17
T_LOCKING, T_GATHERED = 18, 19
ARM, ARM_SLOT, WARMED, T_WARMED, SPUN = 20, 21, 22, 23, 24
GATE, PRELAUNCHED = 25, 26
NWORDS = 27
ERR_TORN, ERR_FAILED = 1, 2
ERRORS = {ERR_TORN: "the write did not finish within its lease: the engine took its weights as torn",
          ERR_FAILED: "the engine failed to apply it (its log says why)"}
POLL_S = 0.005  # the watcher's read of the words without a wake
ARM_S = 0.05  # how long an armed watcher spins for the request: the trainer's step end to its sync call


def now_us() -> int:
    """CLOCK_MONOTONIC in µs: the T_ words' clock, comparable between the trainer and the engine."""
    return time.monotonic_ns() // 1000


def float_word(x: float) -> int:
    """A float64 as the int64 word with its bits (THRESH, DELTA)."""
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def word_float(w: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", w))[0])


def make_words() -> torch.Tensor:
    """The engine's words, zero (no request yet); shared with the trainer by the plan's payload."""
    return torch.zeros(NWORDS, dtype=torch.int64)


class Words:
    """Loads and stores of the shared words (a numpy view: one 8-byte access, no torch dispatch)."""

    def __init__(self, t: torch.Tensor):
        if t.dtype != torch.int64 or t.device.type != "cpu" or t.numel() < NWORDS:
            raise ValueError(f"the handshake words are int64 [{NWORDS}] in CPU memory, got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")
        self.tensor = t  # keeps the shared storage alive
        self.a = t.numpy()

    def __getitem__(self, i: int) -> int:
        return int(self.a[i])

    def __setitem__(self, i: int, value: int) -> None:
        self.a[i] = value


SPIN_S = 0.005  # how long `wait_word` spins (yielding the GIL) before it sleeps between reads: past a GPU fold's time


def wait_word(words: Words, i: int, accept: Callable[[int], bool], timeout_s: float, what: str) -> int:
    """Spin, then sleep briefly between reads, until `accept(words[i])`; TimeoutError naming `what` after
    `timeout_s`."""
    start = time.monotonic()
    while True:
        value = words[i]
        if accept(value):
            return value
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise TimeoutError(f"{what}: no answer in shared memory within {timeout_s:g} s")
        if waited < SPIN_S:
            os.sched_yield()  # the GIL and the core to others (time.sleep(0) pays ~50-70 µs of timer slack)
        else:
            time.sleep(20e-6)


def _fifo_dir() -> str:
    """Where both sides find the FIFO: beside the shared-memory segments when there is /dev/shm."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


_NAMED: set[str] = set()  # the FIFOs of this process that still have a name


def unlink_fifos(signum: int, frame: object) -> None:
    """A signal handler (the engine's SIGTERM): remove this process's FIFO names, then die of the signal as before."""
    for path in list(_NAMED):
        with contextlib.suppress(OSError):
            os.unlink(path)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


class Wake:
    """The engine's end of the wake FIFO (read and write open, so it never sees end of file)."""

    def __init__(self) -> None:
        self.path = os.path.join(_fifo_dir(), f"kora-colocated-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        os.mkfifo(self.path, 0o600)
        _NAMED.add(self.path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)

    def wait(self, timeout_s: float) -> None:
        """Return on a wake or after `timeout_s` (at once when closed); drains what was written."""
        if self.fd < 0:
            return
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout_s))
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self.fd, 4096)

    def poke(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending), or closed
            os.write(self.fd, b"\0")

    def unlink(self) -> None:
        """The name goes (the trainer unlinks it once opened; the watcher at the first request, and `close`,
        cover a trainer that did not); the open ends keep working."""
        _NAMED.discard(self.path)
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


class Waker:
    """The trainer's end: one byte per word the engine waits for. Opened once at plan time, then unlinked (both
    ends hold it open); where it cannot be opened the engine still reads the words every POLL_S."""

    def __init__(self, path: str | None):
        self.fd: int | None = None
        self.problem: str | None = None
        if not path:
            self.problem = "the engine named no wake FIFO"
            return
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            self.problem = f"the wake FIFO {path}: {e}"
            return
        with contextlib.suppress(OSError):
            os.unlink(path)

    def __call__(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(BlockingIOError):  # a full pipe: the engine has a wake pending already
                os.write(self.fd, b"\0")

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
