"""Test-only fault: the checkpoint writer SIGKILLs its own process inside its n-th write
(`KORA_TRAINER_FAULT_CHECKPOINT_KILL_AT`).

`files:2` kills it in the second `lora_only.save` of the process once every file is in the temp dir but before
the rename (a torn `.step_*.tmp-*` stays behind); `renamed:1` in the first, after the rename but before `latest`
moves (a step dir newer than `latest`). A write takes some 50 ms on the toy, which a kill from outside cannot
land reliably on a loaded 2-core machine; the chaos tests (tests/chaoskit.py) set this instead, then kill the
rest of the trainer. Like `lora/gdn.GATE_MASK_OFF_ENV` it is never set in production; unset, nothing is counted.
"""

from __future__ import annotations

import os
import signal

KILL_AT_ENV = "KORA_TRAINER_FAULT_CHECKPOINT_KILL_AT"
PHASES = ("files", "renamed")


def parse_kill_at(spec: str | None) -> tuple[str, int] | None:
    """'phase:n' -> (phase, n); None when unset. A malformed value fails the first write, loudly."""
    if not spec:
        return None
    phase, _, n = spec.partition(":")
    if phase not in PHASES or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{KILL_AT_ENV}={spec!r}: expected 'phase:n' with phase one of {PHASES} and n >= 1, "
                         "e.g. files:2")
    return phase, int(n)


class KillAt:
    """Counts this process's checkpoint writes; `reached(phase)` SIGKILLs the process at the chosen one."""

    def __init__(self) -> None:
        self.writes = 0

    def write_started(self) -> None:
        self.writes += 1

    def reached(self, phase: str) -> None:
        target = parse_kill_at(os.environ.get(KILL_AT_ENV))
        if target is not None and target == (phase, self.writes):
            os.kill(os.getpid(), signal.SIGKILL)


KILL_AT = KillAt()
