"""The trainer's control-plane HTTP API (port 8068): what the operator polls for `status.progress`.

    GET /status   (Authorization: Bearer <token>)
      {"step", "totalSteps", "rewardMean",
       "lastSync": {"mode", "bytes", "milliseconds", "adapterVersion", "checksum", "time"},
       "lastCheckpoint": {"path", "step"} | null,
       "phase": "Starting" | "Running" | "Succeeded" | "Failed", "syncMode", "message",
       "syncedStep": the last step whose policy the engines serve, pushed or delta-skipped,
       "resumedFromStep": the checkpoint step this run resumed from | null (a fresh start)}
    GET /healthz  (open) -> 200 "ok"
    GET /metrics  (open) -> Prometheus text: the same progress as gauges (tracking/prometheus.py)

/metrics is open like /healthz, not behind the token: it reads nothing /status does not (numbers only: no paths,
no messages, no config), changes nothing, and a PodMonitor that scrapes every trainer cannot hold each job's own
token (one Secret per job, derived by the operator). Who may reach the port at all is the per-job NetworkPolicy's
business (the operator only, unless the chart's monitoring.trainers.networkPolicy admits Prometheus too).

The answer is the model `kora_trainer.config.status.TrainerStatus`, which the operator parses it with: its
`Progress` keys the operator copies into the LoRATrainingJob status; `phase`, `syncMode`, `message`,
`syncedStep` and `resumedFromStep` are extra. A stale policy on
the engines shows as `lastSync.adapterVersion < step` (unless `syncedStep` says a skip kept it current).

The token: env KORA_CONTROL_TOKEN, else the file named by KORA_CONTROL_TOKEN_FILE (the operator mounts
the job's Secret there), else a fresh random token written (mode 0600) into the run directory. The port:
--control-port, else KORA_CONTROL_PORT, else 8068. It binds 127.0.0.1 unless KORA_CONTROL_HOST says
otherwise (in a Ray head pod the operator reaches it on the pod IP: set KORA_CONTROL_HOST=0.0.0.0).

Linger: the operator learns the final phase from /status, so a run that ends must not take the API down
before anyone read it. `ControlPlane.linger(seconds)` keeps serving until one authorized GET /status has
returned a final phase (Succeeded / Failed) or `seconds` passed, whichever comes first; the trainer calls
it at the end with env KORA_CONTROL_LINGER_S (default 0: stop at once).

Hostile input gets a 4xx with a JSON `{"error": message}`, never a 5xx, a reset or a hang: every method is
answered (405 on a known path, 404 on another; never http.server's 501), a body over MAX_BODY (1 MiB) is a
413, a Content-Length that is not a number a 400, a chunked body a 411, a body short of its Content-Length a
400 (the client closed) or a 408 (it stalled past `read_timeout_s`), and http.server's own refusals (a bad
request line, a header too long) come as JSON too. What was not read of a refused body is drained, bounded
(DRAIN_LIMIT bytes, DRAIN_S seconds), before the connection closes, so the client reads the answer rather
than a reset. tests/unit/test_hostile_input.py sends the barrage.

The KORA_CONTROL_* variables are the fields of `kora_trainer.config.control.ControlEnv`, which the operator
writes them with.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from kora_trainer.config.control import CONTROL_PORT, ControlEnv
from kora_trainer.config.sections import SyncMode
from kora_trainer.config.status import FINAL_PHASES, SyncProgress, TrainerStatus, rfc3339
from kora_trainer.tracking.prometheus import trainer_registry


class Progress:
    """The run's TrainerStatus as the loop moves it on, behind a lock (the HTTP threads read it while the loop
    writes it). Every change is checked against the model, so /status answers only what it declares."""

    def __init__(self, total_steps: int, sync_mode: str):
        self._lock = threading.Lock()
        self._status = TrainerStatus(step=0, total_steps=total_steps, sync_mode=SyncMode(sync_mode))

    def update(self, **fields: Any) -> None:
        """Set fields by their /status (camelCase) names: update(step=3, rewardMean=0.5)."""
        unknown = set(fields) - _KEYS
        if unknown:
            raise TypeError(f"no /status field {sorted(unknown)}: the fields are {sorted(_KEYS)}")
        with self._lock:
            self._set(fields)

    def record_sync(self, report: Mapping[str, Any], step: int | None = None) -> None:
        """A sync of policy `step`: pushed, or skipped because the engines' copy is equivalent (delta-skip).
        Either way the engines serve that step's policy, which `syncedStep` says; `lastSync` keeps the last
        push (a skip moves no bytes and leaves adapterVersion at the last pushed version)."""
        last = SyncProgress(mode=report["mode"], bytes=report["bytes"], milliseconds=report["ms"],
                            adapter_version=report["adapter_version"], checksum=report["checksum"], time=rfc3339())
        changes: dict[str, Any] = {} if step is None else {"syncedStep": step}
        with self._lock:
            if report["pushed"] or self._status.last_sync is None:
                changes["lastSync"] = last
            self._set(changes)

    def _set(self, fields: Mapping[str, Any]) -> None:
        # under the lock; a frozen model replaced whole, so a reader never sees half an update
        self._status = TrainerStatus.model_validate({**self._status.model_dump(by_alias=True), **fields})

    def snapshot(self) -> dict[str, Any]:
        """The /status answer, as JSON-ready data."""
        with self._lock:
            status = self._status
        return status.model_dump(by_alias=True, mode="json")


_KEYS = frozenset(str(f.alias) for f in TrainerStatus.model_fields.values())


def resolve_token(run_dir: Path) -> tuple[str, str]:
    """(token, where it came from)."""
    env = ControlEnv.from_env(only=("token", "token_file"))
    if env.token:
        return env.token, f"env {ControlEnv.env_name('token')}"
    if env.token_file:
        token = Path(env.token_file).read_text().strip()
        if not token:
            raise ValueError(f"{ControlEnv.env_name('token_file')} {env.token_file} is empty")
        return token, env.token_file
    run_dir.mkdir(parents=True, exist_ok=True)
    file = run_dir / "control-token"
    token = secrets.token_urlsafe(24)
    file.touch(mode=0o600)
    file.write_text(token + "\n")
    return token, str(file)


def resolve_port(flag: int | None) -> int:
    if flag is not None:
        return flag
    port = ControlEnv.from_env(only=("port",)).port
    return CONTROL_PORT if port is None else port


def resolve_linger() -> tuple[float, str | None]:
    """(seconds from KORA_CONTROL_LINGER_S, a warning when the value was unusable and 0 is used): lingering
    is a courtesy to the operator, no reason to fail a run."""
    name = ControlEnv.env_name("linger_s")
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0.0, None
    try:
        return ControlEnv.model_validate({name: raw}).linger_s, None
    except ValidationError as e:
        if e.errors()[0]["type"] == "float_parsing":
            return 0.0, f"{name}={raw!r} is not a number of seconds: not lingering"
        return 0.0, f"{name}={raw!r} must be a finite number >= 0: not lingering"  # NaN, negative, infinite


class Routes(Protocol):
    """More routes under one path prefix (multi-adapter jobs: adapter_runs/api.py), behind the same token."""

    prefix: str

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, Any]: ...


MAX_BODY = 1 << 20  # a request body larger than this is refused (413), for every route
DRAIN_LIMIT = 64 << 20  # after a refusal, at most this much of an unread body is read and dropped ...
DRAIN_S = 5.0  # ... for at most this long, so that the client reads the answer instead of a reset
READ_TIMEOUT_S = 30.0  # a request line, header or body that does not come within this is dropped / a 408
ROUTES = "GET /status, GET /healthz, GET /metrics"
OPEN = ("/healthz", "/metrics")  # answered without the token (see the module's docstring for why)


class _Refused(Exception):
    """A request answered with an error before its route ran (`status`, `message`; `linger`: drain what is left
    of it before closing)."""

    def __init__(self, status: int, message: str, linger: bool = True):
        super().__init__(message)
        self.status, self.message, self.linger = status, message, linger


class _Handler(BaseHTTPRequestHandler):
    """One request to a ControlPlane (`plane`, set on the subclass each plane makes; `timeout`, the socket's
    read timeout, too). Every answer is JSON, errors `{"error": message}` with a 4xx: an unknown method is a 405
    (a 404 on an unknown path), a body over MAX_BODY a 413, a body that is short of its Content-Length a 400
    (the client closed) or a 408 (it stalled). Whatever of a body was not read is drained, bounded, before the
    connection closes, so the client gets the answer and not a reset."""

    plane: ControlPlane
    # buffered, so an answer's headers and body leave in one write: a trainer that exits while a poller reads
    # cuts the connection before the answer or after it, never between its headers and its body
    wbufsize = 1 << 16

    def log_message(self, *args: Any) -> None:  # the operator polls; keep the trainer's log clean
        pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (bad request line, header too long, ...) as JSON, like every other answer.
        Its 501 for a method without a do_<METHOD> (a server fault, it says) goes to the routes instead: they
        answer 405 on a known path, 404 on another; its 505 for an HTTP/2+ request line is a 400."""
        if code == HTTPStatus.NOT_IMPLEMENTED and self.command:
            self._dispatch()
            return
        if code == HTTPStatus.HTTP_VERSION_NOT_SUPPORTED:  # the client's choice of version: a 4xx, not a 5xx
            code, message = HTTPStatus.BAD_REQUEST, f"{message}: send HTTP/1.1 or HTTP/1.0"
        if self.request_version == "HTTP/0.9":  # a request line it could not read: still a status line back
            self.request_version = "HTTP/1.0"
        short = self.responses.get(code, ("", ""))[0]
        self.close_connection = True
        self._send(code, {"error": f"{short}: {message}" if message and message != short else short or str(code)})
        self._linger()  # the rest of a request line or header it stopped reading may still be on the socket

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.request_version == "HTTP/0.9":  # no status line, no headers: nothing of this API fits in it
            self.send_error(HTTPStatus.BAD_REQUEST, "HTTP/0.9 is not served: send HTTP/1.1 or HTTP/1.0")
            return False
        return True

    def _send(self, code: int, body: Any, headers: Mapping[str, str] | None = None) -> None:
        self._send_bytes(code, json.dumps(body).encode(), "application/json", headers)

    def _send_bytes(self, code: int, data: bytes, content_type: str, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        with contextlib.suppress(OSError):  # the poller gave up waiting
            if self.command != "HEAD":
                self.wfile.write(data)
            self.wfile.flush()

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {self.plane.token}".encode()):
            return True
        self._send(401, {"error": "Unauthorized: send Authorization: Bearer <control-plane token>"})
        return False

    def _body(self) -> bytes:
        """The request body (b"" without one), or _Refused."""
        if self.headers.get("Transfer-Encoding"):
            raise _Refused(411, "chunked bodies are not read here: send the body with a Content-Length")
        raw = self.headers.get("Content-Length")
        if raw is None:
            return b""
        if not raw.strip().isdigit():
            raise _Refused(400, f"Content-Length {raw!r} is not a number of bytes")
        length = int(raw)
        if length > MAX_BODY:
            raise _Refused(413, f"request body of {length} bytes is over the limit of {MAX_BODY} bytes")
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            raise _Refused(408, f"the request body did not arrive within {self.timeout} s: send as many bytes as "
                                "Content-Length says", linger=False) from None  # a stalled client: no waiting on it
        if len(body) < length:
            raise _Refused(400, f"the request body ended after {len(body)} of its {length} bytes (Content-Length)")
        return body

    def _dispatch(self) -> None:
        try:
            body = self._body()
            self._route(self.command, urlsplit(self.path).path, body)
        except _Refused as e:
            self.close_connection = True
            self._send(e.status, {"error": e.message})
            if e.linger:
                self._linger()
        except Exception as e:  # a bug, not the client's fault: still an answer, never a dropped connection
            self.close_connection = True
            self._send(500, {"error": f"internal error: {type(e).__name__}: {e}"})

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_TRACE = _dispatch

    def _linger(self) -> None:
        """After an answer to a request not read to its end: close our side (the client sees the answer end),
        then read and drop what it still sends until it closes, at most DRAIN_LIMIT bytes for DRAIN_S seconds.
        Closing a socket with unread bytes sends a reset, which can destroy the answer before the client reads
        it (the 10 MB POST that used to be dropped)."""
        left, deadline = DRAIN_LIMIT, time.monotonic() + DRAIN_S
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            while left > 0 and (remaining := deadline - time.monotonic()) > 0:
                self.connection.settimeout(remaining)
                chunk = self.rfile.read1(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)

    def _route(self, method: str, path: str, body: bytes) -> None:
        routes = self.plane.routes
        if routes is not None and (path == routes.prefix or path.startswith(routes.prefix + "/")):
            if self._authorized():
                self._send(*routes.handle(method, self.path, body))
            return
        if path not in ("/status", *OPEN):
            extra = f", {routes.prefix} routes" if routes is not None else ""
            self._send(404, {"error": f"no route {method} {path}: {ROUTES}{extra}"})
        elif method not in ("GET", "HEAD"):
            self._send(405, {"error": f"method {method} not allowed on {path}: {ROUTES}"}, {"Allow": "GET, HEAD"})
        elif path == "/healthz":
            self._send(200, "ok")
        elif path == "/metrics":
            self._send_bytes(200, generate_latest(self.plane.metrics), CONTENT_TYPE_LATEST)
        elif self._authorized():
            self._status()

    def _status(self) -> None:
        snapshot = self.plane.progress.snapshot()
        self._send(200, snapshot)
        if snapshot.get("phase") in FINAL_PHASES and self.command == "GET":
            self.plane.final_read.set()  # the whole answer is written: linger() may stop the server now


class ControlPlane:
    def __init__(self, progress: Progress, token: str, port: int = CONTROL_PORT, host: str | None = None,
                 routes: Routes | None = None, read_timeout_s: float = READ_TIMEOUT_S):
        self.progress, self.token, self.routes = progress, token, routes
        self.final_read = threading.Event()  # set once an authorized GET /status returned a final phase
        self.metrics = trainer_registry(progress.snapshot)
        host = host or ControlEnv.from_env(only=("host",)).host or "127.0.0.1"
        handler = type("Handler", (_Handler,), {"plane": self, "timeout": read_timeout_s})
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="control-plane", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> ControlPlane:
        self.thread.start()
        return self

    def linger(self, seconds: float) -> bool:
        """Keep serving until an authorized GET /status has returned a final phase (a read before this call
        counts too) or `seconds` passed. Call after setting the final phase. True when it was read."""
        if self.final_read.is_set():
            return True
        if seconds <= 0:
            return False
        return self.final_read.wait(seconds)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
