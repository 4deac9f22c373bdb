"""Test-only fault: the engine SIGKILLs itself on the n-th call of a route (`KORA_ENGINE_FAULT_EXIT_AT`).

`KORA_ENGINE_FAULT_EXIT_AT=/generate:3` kills the engine when its third /generate request arrives (after the
request is read, before it is answered), `/kora/fast_sync/push:2` inside the second fast-path push (the trainer
is broadcasting the bucket then), `/update_weights_from_distributed:1` inside the first HTTP-path one. The chaos
tests use it to land an engine death exactly mid-generate or mid-sync, which a kill from outside cannot time on a
60 ms call (tests/chaoskit.py). Like `KORA_ENGINE_FAULT_DROP_ADAPTER` (adapter_registry.py) it is never set in
production; unset, nothing is counted.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from typing import Any

from aiohttp import web

EXIT_AT_ENV = "KORA_ENGINE_FAULT_EXIT_AT"


def parse_exit_at(spec: str | None) -> tuple[str, int] | None:
    """'/route:n' -> ('/route', n); None when unset. A malformed value stops the engine at start, loudly."""
    if not spec:
        return None
    path, _, n = spec.rpartition(":")
    if not path.startswith("/") or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{EXIT_AT_ENV}={spec!r}: expected '/route:n' with n >= 1, e.g. /generate:3")
    return path, int(n)


class ExitAt:
    """An aiohttp middleware that counts the calls of one route and SIGKILLs this process on the n-th."""

    def __init__(self, spec: str | None = None):
        self.target = parse_exit_at(spec if spec is not None else os.environ.get(EXIT_AT_ENV))
        self.calls: Counter[str] = Counter()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.target is not None and request.path == self.target[0]:
            self.calls[request.path] += 1
            if self.calls[request.path] == self.target[1]:
                await request.read()  # the caller has sent it all: the death lands inside the call
                os.kill(os.getpid(), signal.SIGKILL)
        response: web.StreamResponse = await handler(request)
        return response
