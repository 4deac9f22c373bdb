"""The request ids the rollout manager has in flight, per rid prefix (multi-LoRA: `<adapter>::`), so a retire can
abort one adapter's requests on a build that cannot abort by prefix.

A stock SGLang (0.5.17, 0.5.23) aborts one rid exactly (`AbortReq` has no `prefix`; a rid its tokenizer manager does
not track is dropped: config/sglang_builds.py's docstring has the lines). The rollout manager mints every rid
(`<prefix><uuid>`), so it knows them: each /generate call's rids are added here before the call and removed when it
returns. `close(prefix)` stops the prefix (a call not yet sent is not sent: it answers aborted without reaching an
engine, so nothing new starts under a name being retired) and says which rids each engine holds; `open(prefix)`
lets it run again (the name registered anew). Thread-safe: the adapters' calls run on the rollout actor's threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class InFlightRids:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rids: dict[str, dict[str, int]] = {}  # prefix -> {rid: engine index}
        self._closed: set[str] = set()

    @contextmanager
    def sent(self, prefix: str, engine: int, rids: list[str]) -> Iterator[bool]:
        """Hold `rids` (sent to `engine`) for the call's length; yields False, holding nothing, when the prefix is
        closed (the call must not be sent)."""
        with self._lock:
            if prefix in self._closed:
                ok = False
            else:
                ok = True
                self._rids.setdefault(prefix, {}).update((r, engine) for r in rids)
        try:
            yield ok
        finally:
            if ok:
                with self._lock:
                    held = self._rids.get(prefix, {})
                    for r in rids:
                        held.pop(r, None)
                    if not held:
                        self._rids.pop(prefix, None)

    def close(self, prefix: str) -> dict[int, list[str]]:
        """Stop `prefix`: no call of it is sent from now on; returns the rids in flight per engine."""
        with self._lock:
            self._closed.add(prefix)
        return self.held(prefix)

    def open(self, prefix: str) -> None:
        with self._lock:
            self._closed.discard(prefix)

    def is_closed(self, prefix: str) -> bool:
        with self._lock:
            return prefix in self._closed

    def held(self, prefix: str) -> dict[int, list[str]]:
        """The rids of `prefix` in flight, per engine index."""
        out: dict[int, list[str]] = {}
        with self._lock:
            for rid, engine in self._rids.get(prefix, {}).items():
                out.setdefault(engine, []).append(rid)
        return out
