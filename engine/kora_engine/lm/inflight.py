"""The requests the engine holds (admitted, not yet answered), for `/abort_request` and `GET /kora/state`.

`/abort_request` takes SGLang's `AbortReq` body (io_struct.py: `rid`, `abort_all`; the HTTP handler passes
only those two on) plus sglang-miles' `prefix` flag (sgl-project/sglang #30912, port #32237):
- `{"rid": R}`: the request whose rid is R (the tokenizer manager drops a rid it does not track, so a
  prefix without the flag aborts nothing);
- `{"rid": P, "prefix": true}`: every request whose rid starts with P (multi-LoRA rids are
  `<adapter>::<uuid>`, so `{"rid": "<adapter>::", "prefix": true}` clears one adapter's requests);
- `{"abort_all": true}`: every request.
The route answers 200 with an empty body, as SGLang does; each aborted request ends at its next decode
step with finish_reason `{"type": "abort", "message": "Aborted", ...}` and the tokens it had
(`model.aborted_by_request`), a request still queued behind a running batch ends with none.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kora_engine.lm.model import GenRequest

RID_PREFIX_SEP = "::"  # miles' multi-LoRA request ids: f"{adapter}{RID_PREFIX_SEP}{uuid}"


def rid_prefix(rid: str) -> str | None:
    """`<adapter>::` for a namespaced rid, else None."""
    head, sep, _ = rid.partition(RID_PREFIX_SEP)
    return head + sep if sep else None


class InFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[int, GenRequest] = {}

    @contextmanager
    def track(self, requests: Sequence[GenRequest]) -> Iterator[None]:
        """Hold `requests` as in flight from admission (their adapter resolved) until they are answered."""
        with self._lock:
            self._requests.update((id(r), r) for r in requests)
        try:
            yield
        finally:
            with self._lock:
                for r in requests:
                    self._requests.pop(id(r), None)

    def abort(self, rid: str | None, prefix: bool = False, abort_all: bool = False) -> int:
        """Mark the matching requests aborted; returns how many (the route does not report it, SGLang's neither)."""
        with self._lock:
            hits = [r for r in self._requests.values() if not r.aborted and (
                abort_all or (rid is not None and (r.rid.startswith(rid) if prefix else r.rid == rid)))]
            for r in hits:
                r.aborted = True
        return len(hits)

    def state(self) -> dict[str, Any]:
        """In-flight counts: all, per adapter name, per adapter version (its weight_version, else its
        lora_id), per rid prefix (`<adapter>::`). The base model's requests count only in the total."""
        with self._lock:
            reqs = list(self._requests.values())
        by_adapter: Counter[str] = Counter()
        by_version: dict[str, Counter[str]] = {}
        by_prefix: Counter[str] = Counter()
        for r in reqs:
            if r.adapter is not None:
                by_adapter[r.adapter.name] += 1
                by_version.setdefault(r.adapter.name, Counter())[r.adapter.version or r.adapter.lora_id] += 1
            p = rid_prefix(r.rid)
            if p is not None:
                by_prefix[p] += 1
        return {"in_flight": len(reqs), "in_flight_by_adapter": dict(by_adapter),
                "in_flight_by_adapter_version": {k: dict(v) for k, v in by_version.items()},
                "in_flight_by_rid_prefix": dict(by_prefix)}
