"""Test-only record of every call the engine answered (`KORA_ENGINE_RECORD=<file>`): one JSON line per request —
method, path, status and the JSON body (serialized tensors replaced by their count) — appended as it is answered.

The strict-build tests (tests/sglang_buildkit.py) check a trainer's calls against the build's routes and request
structs with it: "no request the trainer sent has a route or field the build lacks" is read off what arrived, not
off what the sender meant to send. Unset (production), nothing is recorded.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from aiohttp import web

RECORD_ENV = "KORA_ENGINE_RECORD"
_BULKY = ("serialized_named_tensors",)  # megabytes of pickles: their count is what a check needs


def _shown(body: Any) -> Any:
    if isinstance(body, dict):
        return {k: (f"<{len(v)} items>" if k in _BULKY and isinstance(v, list) else v) for k, v in body.items()}
    return body


class CallRecord:
    """An aiohttp middleware appending each answered request to `path` (a JSON-lines file)."""

    def __init__(self, path: str | None = None):
        self.path = path if path is not None else os.environ.get(RECORD_ENV) or None
        self._lock = threading.Lock()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read() if request.can_read_body else b""  # aiohttp keeps it for the handler
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = "<not JSON>"
        response: web.StreamResponse = await handler(request)
        line = json.dumps({"method": request.method, "path": request.path, "query": dict(request.query),
                           "status": response.status, "body": _shown(body)})
        with self._lock, open(str(self.path), "a") as f:
            f.write(line + "\n")
        return response
