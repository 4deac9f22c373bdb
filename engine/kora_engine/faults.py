"""Test-only faults: the engine SIGKILLs itself (`KORA_ENGINE_FAULT_EXIT_AT`) or hangs
(`KORA_ENGINE_FAULT_HANG_AT`) on the n-th call of a route.

`KORA_ENGINE_FAULT_EXIT_AT=/generate:3` kills the engine when its third /generate request arrives (after the
request is read, before it is answered), `/kora/fast_sync/push:2` inside the second fast-path push (the trainer
is broadcasting the bucket then), `/update_weights_from_distributed:1` inside the first HTTP-path one.
`KORA_ENGINE_FAULT_HANG_AT=/generate:3:stop` makes it SIGSTOP itself there instead (alive, answering nothing),
`...:wedge` block its event loop for good (running, its listening socket still accepting connections, never
answering one): the two hangs orchestration/engine_watch.py's HangWatch must catch. A hang first writes
`HANG_MARK` to the engine's stderr (its log), so a test can time it. The chaos tests use these to land a fault
exactly mid-generate or mid-sync, which a signal from outside cannot time on a 60 ms call (tests/chaoskit.py).
`KORA_ENGINE_FAULT_HOLD_ADAPTER=odd:2` holds the second and later /generate calls carrying adapter `odd` after
admission (tracked in flight, so `/abort_request` reaches them) until each of their requests is aborted, or
HOLD_MAX_S passed: a retire then lands mid-generate for certain (tests/e2e/test_multi_lora_stock_build.py).
Like `KORA_ENGINE_FAULT_DROP_ADAPTER` (adapter_registry.py) they are never set in production; unset, nothing is
counted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections import Counter
from typing import Any

from aiohttp import web

EXIT_AT_ENV = "KORA_ENGINE_FAULT_EXIT_AT"
HANG_AT_ENV = "KORA_ENGINE_FAULT_HANG_AT"
HANGS = ("stop", "wedge")
HANG_MARK = "kora engine fault: hanging"
HOLD_ADAPTER_ENV = "KORA_ENGINE_FAULT_HOLD_ADAPTER"
HOLD_MARK = "kora engine fault: holding"
HOLD_MAX_S = 120.0


def parse_exit_at(spec: str | None, env: str = EXIT_AT_ENV) -> tuple[str, int] | None:
    """'/route:n' -> ('/route', n); None when unset. A malformed value stops the engine at start, loudly."""
    if not spec:
        return None
    path, _, n = spec.rpartition(":")
    if not path.startswith("/") or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{env}={spec!r}: expected '/route:n' with n >= 1, e.g. /generate:3")
    return path, int(n)


def parse_hang_at(spec: str | None) -> tuple[str, int, str] | None:
    """'/route:n:how' -> ('/route', n, how), how one of HANGS; None when unset."""
    if not spec:
        return None
    at, _, how = spec.rpartition(":")
    if how not in HANGS:
        raise ValueError(f"{HANG_AT_ENV}={spec!r}: expected '/route:n:how' with how one of {HANGS}, e.g. "
                         "/generate:3:stop")
    path, n = parse_exit_at(at, HANG_AT_ENV) or ("", 0)
    return path, n, how


class ExitAt:
    """An aiohttp middleware that counts the calls of the faulted routes; on the n-th it SIGKILLs this process
    (exit), or hangs it (stop / wedge)."""

    def __init__(self, spec: str | None = None, hang: str | None = None):
        self.target = parse_exit_at(spec if spec is not None else os.environ.get(EXIT_AT_ENV))
        self.hang = parse_hang_at(hang if hang is not None else os.environ.get(HANG_AT_ENV))
        self.calls: Counter[str] = Counter()

    @property
    def armed(self) -> bool:
        return self.target is not None or self.hang is not None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in {t[0] for t in (self.target, self.hang) if t is not None}:
            self.calls[request.path] += 1
            n = self.calls[request.path]
            if self.target is not None and (request.path, n) == self.target:
                await request.read()  # the caller has sent it all: the death lands inside the call
                os.kill(os.getpid(), signal.SIGKILL)
            if self.hang is not None and (request.path, n) == self.hang[:2]:
                await request.read()
                print(f"{HANG_MARK} ({self.hang[2]}) inside {request.path} call {n}", file=sys.stderr, flush=True)
                if self.hang[2] == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:  # the event loop's own thread waits for ever: nothing is answered again
                    threading.Event().wait()
        response: web.StreamResponse = await handler(request)
        return response


class HoldAdapter:
    """`KORA_ENGINE_FAULT_HOLD_ADAPTER=name:n`: the n-th and later /generate calls with adapter `name` wait,
    admitted, until every one of their requests is aborted (or HOLD_MAX_S)."""

    def __init__(self, spec: str | None = None):
        spec = spec if spec is not None else os.environ.get(HOLD_ADAPTER_ENV)
        self.target: tuple[str, int] | None = None
        if spec:
            name, _, n = spec.rpartition(":")
            if not name or not n.isdigit() or int(n) < 1:
                raise ValueError(f"{HOLD_ADAPTER_ENV}={spec!r}: expected 'adapter:n' with n >= 1, e.g. odd:2")
            self.target = name, int(n)
        self.calls = 0

    async def hold(self, requests: list[Any]) -> None:
        """`requests`: the call's GenRequests (their `adapter` resolved, `aborted` set by /abort_request)."""
        if self.target is None:
            return
        name, n = self.target
        if not any(r.adapter is not None and r.adapter.name == name for r in requests):
            return
        self.calls += 1
        if self.calls < n:
            return
        print(f"{HOLD_MARK} /generate call {self.calls} of adapter {name} until aborted", file=sys.stderr, flush=True)
        deadline = asyncio.get_running_loop().time() + HOLD_MAX_S
        while not all(r.aborted for r in requests) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)  # the test-only hold, bounded by HOLD_MAX_S
