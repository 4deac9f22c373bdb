"""What the driver does when an engine process dies under it: fail the attempt, saying so.

An engine killed mid-generate or mid-sync shows up in the trainer as whatever the call in flight met: a
rollout step with no engine left (rollout_manager.RolloutError), gloo's "Connection reset by peer" inside a
bucket broadcast, an HTTP connection refused. Each of those fails within seconds (measured: 2.8 s from the
kill to the trainer's exit, bench/chaos_trainer.py), well inside the weight-update group's 120 s timeout, but
none of them says an engine died. `engines_watched` wraps a step's calls: on any failure it asks each engine's
worker whether its process is still alive and, if one is not, raises EngineLost naming the engine, its exit
status, what the driver was doing and which checkpoint a retry resumes from.

Why fail rather than restart the engine in place: a new engine would have to join the weight-update group,
which torch.distributed cannot grow (every member re-creates it: the sender's plans, the fast path's buckets
and every other engine's receiver with it), and the step in flight would have to be regenerated anyway. The
job's retry (the operator's backoffLimit, or a rerun) does all of that already and exactly: it resumes from
the newest good checkpoint and, with deployment.async false, redoes the lost steps bit-identically
(tests/e2e/test_chaos_trainer.py), so no step's data is lost; with checkpoint.interval > 1 it redoes up to
interval - 1 steps.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

PROBE_TIMEOUT_S = 10.0  # an engine worker answers from memory (Popen.poll); a dead Ray worker errors at once


class EngineLost(RuntimeError):
    """An engine process exited while the job ran: the attempt fails; a retry resumes from the last checkpoint."""


def exit_words(code: int) -> str:
    """A Popen returncode as words: 'signal SIGKILL', 'exit code 1'."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def dead_engines(engines: list[Any], urls: list[str]) -> list[str]:
    """'engine i (pid P, URL) exited with SIGKILL; log L' for each engine whose process is gone."""
    import ray

    dead = []
    for i, engine in enumerate(engines):
        try:
            code, pid, log = ray.get(engine.exit_status.remote(), timeout=PROBE_TIMEOUT_S)
        except Exception as e:  # the engine's Ray worker itself is gone (it took the engine with it: PDEATHSIG)
            dead.append(f"engine {i} ({urls[i]}): its Ray worker is gone ({type(e).__name__})")
            continue
        if code is not None:
            dead.append(f"engine {i} (pid {pid}, {urls[i]}) exited with {exit_words(code)}; its log: {log}")
    return dead


@contextlib.contextmanager
def engines_watched(engines: list[Any], urls: list[str], doing: str, saved_step: int | None) -> Iterator[None]:
    """Run the body; if it fails and an engine has died, raise EngineLost (the original error as its cause)."""
    try:
        yield
    except Exception as e:
        dead = dead_engines(engines, urls)
        if not dead:
            raise
        resume = (f"the newest checkpoint of this attempt is step {saved_step}" if saved_step is not None
                  else "this attempt saved no checkpoint")
        first = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        raise EngineLost(f"{'; '.join(dead)}; noticed during {doing} ({first}). The attempt stops here: a retry of "
                         f"the job resumes from the newest good checkpoint under checkpoint.path ({resume})") from e
