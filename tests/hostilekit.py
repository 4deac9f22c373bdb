"""Hostile HTTP requests, written as raw bytes and sent on raw sockets, and what came back.

A client that means harm (or is merely broken) sends what no HTTP library would: bytes that are not UTF-8,
JSON that is not JSON, a Content-Length that lies, a body it never finishes, a method nobody serves. So each
case here is the exact bytes of one request, sent on a fresh connection to 127.0.0.1, and the answer is read
with http.client's response parser under a bounded timeout. An outcome is an `answer` (a status code and a
body), a `reset` (ECONNRESET / EPIPE), a `hang` (no answer within the timeout) or `closed` (the server closed
without answering). tests/unit/test_hostile_input.py builds the cases for the reference engine and the
trainer's control plane and asserts that every one is an answer with a 4xx and a message.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hostile:
    """One hostile request: `data` is every byte sent."""

    name: str
    data: bytes
    method: str  # how to read the answer (HEAD has no body)
    expect: frozenset[int] | None = None  # the status codes allowed; None: any 4xx
    text_ok: bool = False  # aiohttp's HTTP parser refuses a broken request line / header in text/plain
    half_close: bool = False  # shut the write side after sending: the body ends short of its Content-Length


@dataclass
class Outcome:
    case: Hostile
    kind: str  # "answer" | "reset" | "hang" | "closed" | "garbled (...)"
    status: int | None = None
    content_type: str = ""
    body: bytes = b""
    seconds: float = 0.0

    def message(self) -> str:
        """The error message the answer carries, in any of the shapes the two servers use ("" when none)."""
        if self.content_type.startswith("text/plain"):
            return self.body.decode("utf-8", "replace").strip()
        try:
            data = json.loads(self.body)
        except ValueError:
            return ""
        if not isinstance(data, dict):
            return ""
        for key in ("error", "detail", "message", "error_message"):  # SGLang's, FastAPI's and kora's shapes
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("message")
            if isinstance(value, str) and value.strip():
                return value
        return ""

    def problem(self) -> str | None:
        """Why this outcome breaks the rule (a 4xx answer with a message), or None."""
        c = self.case
        if self.kind != "answer" or self.status is None:
            return f"{self.kind} after {self.seconds:.1f} s"
        if not 400 <= self.status < 500:
            return f"status {self.status}: {self.body[:300]!r}"
        if c.expect is not None and self.status not in c.expect:
            return f"status {self.status}, expected {sorted(c.expect)}: {self.body[:300]!r}"
        if c.method == "HEAD":  # a HEAD answer has no body by definition
            return None
        if not self.content_type.startswith("application/json") and not (
                c.text_ok and self.content_type.startswith("text/plain")):
            return f"content type {self.content_type!r}: {self.body[:300]!r}"
        if not self.message():
            return f"no message: {self.body[:300]!r}"
        return None


def request(method: str, target: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
            content_length: int | str | None = None, version: str = "HTTP/1.1") -> bytes:
    """The bytes of one request; Content-Length is len(body) unless `content_length` says otherwise
    (None with an empty body on a GET-like method: no Content-Length at all)."""
    lines = [f"{method} {target} {version}", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    elif body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def send(port: int, case: Hostile, timeout_s: float) -> Outcome:
    """Send `case` on a fresh connection and read the answer; every wait is bounded by `timeout_s`."""
    start = time.monotonic()
    out = Outcome(case, "hang")
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    try:
        try:
            sock.sendall(case.data)
            if case.half_close:
                sock.shutdown(socket.SHUT_WR)
        except (ConnectionResetError, BrokenPipeError):
            out.kind = "reset"  # the server closed while the request was still being sent: its answer is lost
            return out
        resp = http.client.HTTPResponse(sock, method=case.method)
        try:
            resp.begin()
            out.body = resp.read()
        except TimeoutError:
            out.kind = "hang"
        except ConnectionResetError:
            out.kind = "reset"
        except (http.client.RemoteDisconnected, http.client.IncompleteRead):
            out.kind = "closed"
        except http.client.HTTPException as e:  # e.g. a body without a status line (what HTTP/0.9 answers)
            out.kind = f"garbled ({type(e).__name__})"
        else:
            out.kind, out.status = "answer", resp.status
            out.content_type = resp.getheader("Content-Type", "") or ""
        return out
    finally:
        out.seconds = time.monotonic() - start
        sock.close()


def barrage(port: int, cases: Sequence[Hostile], timeout_s: float) -> list[Outcome]:
    return [send(port, case, timeout_s) for case in cases]


def tally(outcomes: Iterable[Outcome]) -> dict[str, Any]:
    """Counts by outcome and status code (the figures the test prints and records)."""
    outcomes = list(outcomes)
    by_status = Counter(str(o.status) if o.kind == "answer" else o.kind for o in outcomes)
    by_type = Counter(o.content_type.split(";")[0] or "(none)" for o in outcomes if o.kind == "answer")
    return {"requests": len(outcomes), "by_status": dict(sorted(by_status.items())),
            "by_content_type": dict(sorted(by_type.items())),
            "at_least_500": sum(1 for o in outcomes if o.status is not None and o.status >= 500),
            "resets": sum(1 for o in outcomes if o.kind == "reset"),
            "hangs": sum(1 for o in outcomes if o.kind == "hang"),
            "closed_without_answer": sum(1 for o in outcomes if o.kind == "closed"),
            "slowest_s": round(max((o.seconds for o in outcomes), default=0.0), 3)}


# ---- bodies every JSON route must refuse ---------------------------------------------------------------------

NOT_UTF8 = [b'\xff\xfe{"a": 1}', b'{"lora_name": "\xc3\x28"}', b'{"a": "\xed\xa0\x80"}']  # byte, pair, surrogate
NOT_JSON = [b'{"a": ', b"{a: 1}", b"{'a': 1}", b'{"a": 1,}', b"\x00\x01\x02"]
NOT_AN_OBJECT = [b"[1, 2]", b'"text"', b"42", b"null", b"true"]
NOT_FINITE = [b'{"a": NaN}', b'{"a": -Infinity}', b'{"a": 1e999}']
DEEP = b"[" * 50_000 + b"]" * 50_000


def body_cases(path: str, method: str = "POST", max_body: int | None = None) -> list[Hostile]:
    """The bodies no JSON route may take: not UTF-8, not JSON, not an object, not finite, nested too deep,
    empty; and (max_body given) one byte over the stated limit, which must be a 413."""
    bodies = [*NOT_UTF8, *NOT_JSON, *NOT_AN_OBJECT, *NOT_FINITE, DEEP, b""]
    cases = [Hostile(f"{method} {path} body {i}: {b[:24]!r}", request(method, path, b), method)
             for i, b in enumerate(bodies)]
    if max_body is not None:
        cases.append(Hostile(f"{method} {path} body of {max_body + 1} bytes", request(method, path,
                                                                                      b" " * (max_body + 1)),
                             method, expect=frozenset({413})))
    return cases


def method_cases(path: str, methods: Sequence[str], expect: frozenset[int] = frozenset({405})) -> list[Hostile]:
    """Methods the route does not serve: 405 (HEAD: no body to check)."""
    return [Hostile(f"{m} {path}", request(m, path, b"{}" if m not in ("HEAD", "TRACE") else b""), m, expect)
            for m in methods]


def wrong_type(annotation: Any) -> Any:
    """A JSON value of a type the field does not take: a string for a dict, an object for anything else."""
    return "x" if "dict" in str(annotation) else {"bad": [1]}


def typed_cases(path: str, fields: Mapping[str, Any]) -> list[Hostile]:
    """Every field at once with a wrong type, then each one alone (the others missing)."""
    bodies = [{name: wrong_type(ann) for name, ann in fields.items()}]
    bodies += [{name: wrong_type(ann)} for name, ann in fields.items()]
    return [Hostile(f"POST {path} wrong types {sorted(b)}", request("POST", path, json.dumps(b).encode()), "POST")
            for b in bodies]


def json_cases(path: str, bodies: Iterable[Any], method: str = "POST",
               headers: Mapping[str, str] | None = None) -> list[Hostile]:
    return [Hostile(f"{method} {path} {json.dumps(b)[:80]}", request(method, path, json.dumps(b).encode(), headers),
                    method) for b in bodies]


def framing_cases(path: str, stall: int | None, half_close: int | None, text_ok: bool) -> list[Hostile]:
    """Requests whose framing lies: a Content-Length that is not a number or disagrees with itself, a chunked
    body that is not chunked; a body that stops short of its Content-Length while the client waits (`stall`:
    the code expected, 408) or after it closed its side (`half_close`: the code expected)."""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    cases = [
        Hostile(f"POST {path} Content-Length: abc", (head + "Content-Length: abc\r\n\r\n{}").encode(), "POST",
                text_ok=text_ok),
        Hostile(f"POST {path} Content-Length: -5", (head + "Content-Length: -5\r\n\r\n{}").encode(), "POST",
                text_ok=text_ok),
        Hostile(f"POST {path} chunked, not chunked", (head + "Transfer-Encoding: chunked\r\n\r\nzz\r\n").encode(),
                "POST", text_ok=text_ok),
    ]
    if stall is not None:
        cases.append(Hostile(f"POST {path} 10 of 100 bytes, then silence",
                             (head + "Content-Length: 100\r\n\r\n").encode() + b'{"input_id', "POST",
                             frozenset({stall})))
    if half_close is not None:
        cases.append(Hostile(f"POST {path} 10 of 100 bytes, then EOF", (head + "Content-Length: 100\r\n\r\n").encode()
                             + b'{"input_id', "POST", frozenset({half_close}), half_close=True))
    return cases
