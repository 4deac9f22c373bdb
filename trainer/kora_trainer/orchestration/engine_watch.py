"""What the driver does when an engine process dies or hangs under it: fail the attempt, saying so.

An engine killed mid-generate or mid-sync shows up in the trainer as whatever the call in flight met: a
rollout step with no engine left (rollout_manager.RolloutError), gloo's "Connection reset by peer" inside a
bucket broadcast, an HTTP connection refused. Each of those fails within seconds (bench/chaos_trainer.py),
well inside the weight-update group's 120 s timeout, but none of them says an engine died. `engines_watched`
wraps a step's calls: on any failure it asks each engine's worker whether its process is still alive and, if
one is not, raises EngineLost naming the engine, its exit status, what the driver was doing and which
checkpoint a retry resumes from.

An engine that hangs without dying (SIGSTOPped, or wedged: it accepts connections and never answers) fails
nothing by itself: the call in flight would wait out its own timeout (600 s for a /generate, 300 s for a push's
HTTP answer, the group's 120 s for a broadcast that fills the socket). So each engine's worker runs a HangWatch
beside it: it asks the engine's GET /health every second or so, and once the engine has left it unanswered for
rollout.engineHangSeconds it SIGKILLs the engine and remembers why. The call in flight then fails at once (the
dead engine's sockets close), and EngineLost says the engine hung, for how long, in what process state, during
what, and what to raise if it was only slow. A busy engine answers /health at once (SGLang counts any
scheduler output, the reference engine any work in progress), so the watch does not mistake load for a hang.
The bound from the hang to the attempt's failure is engineHangSeconds plus one probe interval plus the death
path's seconds (tests/e2e/test_chaos_trainer.py measures it).

Why fail rather than restart the engine in place, or carry on with the engines left: a new engine would have
to join the weight-update group, which torch.distributed cannot grow or shrink (every member re-creates it: the
sender's plans, the fast path's buckets and every other engine's receiver with it), so the very next push to
the others would fail on the missing member; and the step in flight would have to be regenerated anyway.
Within one step the rollout manager does route around an engine whose call fails (its requests go to the
others), but the sync that follows cannot. The job's retry (the operator's backoffLimit, or a rerun) does all
of that already and exactly: it resumes from the newest good checkpoint and, with deployment.async false,
redoes the lost steps bit-identically (tests/e2e/test_chaos_trainer.py), so no step's data is lost; with
checkpoint.interval > 1 it redoes up to interval - 1 steps.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kora_trainer.wire.engine_client import EngineClient

PROBE_TIMEOUT_S = 10.0  # an engine worker answers from memory (Popen.poll); a dead Ray worker errors at once
PROBE_INTERVAL_S = 1.0  # how often a HangWatch asks /health (a fifth of engineHangSeconds when that is shorter)
STATES = {"T": "stopped (SIGSTOP)", "t": "stopped by a tracer", "D": "in uninterruptible I/O", "R": "running",
          "S": "sleeping", "Z": "a zombie"}


class EngineLost(RuntimeError):
    """An engine process exited or hung while the job ran: the attempt fails; a retry resumes from the last
    checkpoint."""


@dataclass(frozen=True)
class EngineStatus:
    """An engine worker's answer after a failure (what crosses Ray from EngineWorker.status)."""

    code: int | None  # the engine's exit code, None while it runs
    pid: int
    log: str
    hung: str = ""  # why its HangWatch killed it ("" unless it did)


def exit_words(code: int) -> str:
    """A Popen returncode as words: 'signal SIGKILL', 'exit code 1'."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def process_state(pid: int) -> str:
    """A process's state in words ('stopped (SIGSTOP)', 'sleeping', ...), 'gone' when it is."""
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return STATES.get(letter, f"state {letter}")


class HangWatch:
    """Asks one engine's GET /health every `interval_s`; once it has gone `hang_s` without an answered probe it
    SIGKILLs the engine and keeps why in `hung`. `settle` lets a caller wait for the watch's word on it."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, hang_s: float,
                 interval_s: float = PROBE_INTERVAL_S):
        self.proc, self.url, self.hang_s = proc, url, hang_s
        self.interval_s = min(interval_s, hang_s / 5)
        self.client = EngineClient(url, connect_timeout=hang_s, pool_size=1)
        self.hung = ""
        self.answered = time.monotonic()  # when the last answered probe started
        self.probes = 0  # probes finished; `settle` waits for one that started after it was called
        self.last_ok = True
        self.cond = threading.Condition()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="engine-hang-watch", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s) and self.proc.poll() is None:
            started = time.monotonic()
            ok = self.client.health(timeout=max(0.2, self.answered + self.hang_s - started))
            with self.cond:
                self.probes += 1
                self.last_ok = ok
                if ok:
                    self.answered = started
                elif time.monotonic() - self.answered >= self.hang_s and self.proc.poll() is None \
                        and not self._stop.is_set():
                    # the verdict before the kill: whoever sees the engine's sockets close may ask for it
                    self.hung = (f"hung: GET /health unanswered for {time.monotonic() - self.answered:.1f} s "
                                 f"(rollout.engineHangSeconds {self.hang_s:g}; its process was "
                                 f"{process_state(self.proc.pid)}), so the trainer killed it")
                    self.proc.kill()  # SIGKILL: a stopped process takes nothing else
                    self.proc.wait()
                self.cond.notify_all()

    def settle(self, timeout_s: float) -> None:
        """Until a probe that started after this call has finished answered, or the engine is dead (killed as hung
        or otherwise), or `timeout_s`: so a failure the driver saw first gets the watch's verdict on the engine."""
        with self.cond:
            after = self.probes + 1  # the probe in flight may have started before the trouble
            self.cond.wait_for(lambda: self.proc.poll() is not None or (self.probes > after and self.last_ok),
                               timeout=timeout_s)

    def stop(self) -> None:
        """No more probes nor kills; a probe in flight is left to its daemon thread (it may wait on a hung engine)."""
        self._stop.set()
        self.thread.join(2 * self.interval_s)


def dead_engines(engines: list[Any], urls: list[str], settle_s: float = 0.0) -> list[str]:
    """'engine i (pid P, URL) exited with SIGKILL; log L' for each engine whose process is gone, or 'engine i
    (pid P, URL) hung: ...' for one its HangWatch killed (each worker first waits up to `settle_s` for its
    watch's word: an engine that hung just before the failure is found hung, not alive)."""
    import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

    dead = []
    for i, status in enumerate([engine.status.remote(settle_s) for engine in engines]):
        try:
            st: EngineStatus = ray.get(status, timeout=settle_s + PROBE_TIMEOUT_S)
        except Exception as e:  # the engine's Ray worker itself is gone (it took the engine with it: PDEATHSIG)
            dead.append(f"engine {i} ({urls[i]}): its Ray worker is gone ({type(e).__name__})")
            continue
        if st.hung:
            dead.append(f"engine {i} (pid {st.pid}, {urls[i]}) {st.hung}; its log: {st.log}")
        elif st.code is not None:
            dead.append(f"engine {i} (pid {st.pid}, {urls[i]}) exited with {exit_words(st.code)}; its log: {st.log}")
    return dead


@contextlib.contextmanager
def engines_watched(engines: list[Any], urls: list[str], doing: str, saved_step: int | None,
                    hang_s: float = 0.0, resume: str | None = None) -> Iterator[None]:
    """Run the body; if it fails and an engine has died or hung, raise EngineLost (the original error as its
    cause). `hang_s`: rollout.engineHangSeconds (the engines' hang watches get that and two probes to decide);
    `resume`: what a retry resumes from, when not the one checkpoint of `saved_step` (a multi-adapter job's)."""
    try:
        yield
    except Exception as e:
        dead = dead_engines(engines, urls, hang_s + 2 * PROBE_INTERVAL_S if hang_s else 0.0)
        if not dead:
            raise
        raise lost(dead, doing, e, saved_step, resume) from e


def lost(dead: list[str], doing: str, e: BaseException, saved_step: int | None, resume: str | None = None
         ) -> EngineLost:
    """EngineLost naming the `dead` engines (dead_engines' words), what the driver was `doing`, the failure it
    met, what a retry resumes from and, for a hang, what to raise if the engine was only slow."""
    if resume is None:
        resume = (f"the newest checkpoint of this attempt is step {saved_step}" if saved_step is not None
                  else "this attempt saved no checkpoint")
    hung = any(" hung: " in d for d in dead)
    fix = (" If the engine was only slow (its scheduler silent that long on purpose), raise "
           "rollout.engineHangSeconds." if hung else "")
    first = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
    return EngineLost(f"{'; '.join(dead)}; noticed during {doing} ({first}). The attempt stops here: a retry of "
                      f"the job resumes from the newest good checkpoint under checkpoint.path ({resume}).{fix}")


@contextlib.contextmanager
def engine_process_watched(proc: subprocess.Popen[bytes], url: str, log: Path, watch: HangWatch | None,
                           doing: str, saved_step: int | None) -> Iterator[None]:
    """`engines_watched` for one engine process of this driver's own (the diffusion driver's, no Ray): a failure
    while it is dead, or once its `watch` killed it as hung, becomes EngineLost naming it."""
    try:
        yield
    except Exception as e:
        if proc.poll() is None and watch is not None:
            watch.settle(watch.hang_s + 2 * PROBE_INTERVAL_S)
        code = proc.poll()
        if code is None:
            raise
        what = watch.hung if watch is not None and watch.hung else f"exited with {exit_words(code)}"
        raise lost([f"engine 0 (pid {proc.pid}, {url}) {what}; its log: {log}"], doing, e, saved_step) from e
