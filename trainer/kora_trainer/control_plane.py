"""The trainer's control-plane HTTP API (port 8068): what the operator polls for `status.progress`.

    GET /status   (Authorization: Bearer <token>)
      {"step", "totalSteps", "rewardMean",
       "lastSync": {"mode", "bytes", "milliseconds", "adapterVersion", "checksum", "time"},
       "lastCheckpoint": {"path", "step"} | null,
       "phase": "Starting" | "Running" | "Succeeded" | "Failed", "syncMode", "message",
       "syncedStep": the last step whose policy the engines serve, pushed or delta-skipped,
       "resumedFromStep": the checkpoint step this run resumed from | null (a fresh start)}
    GET /healthz  (open) -> 200 "ok"

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

The KORA_CONTROL_* variables are the fields of `kora_trainer.config.control.ControlEnv`, which the operator
writes them with.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from kora_trainer.config.control import CONTROL_PORT, ControlEnv
from kora_trainer.config.sections import SyncMode
from kora_trainer.config.status import FINAL_PHASES, SyncProgress, TrainerStatus, rfc3339


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


MAX_BODY = 1 << 20  # a request body larger than this is refused (413)


class _Handler(BaseHTTPRequestHandler):
    """One request to a ControlPlane (`plane`, set on the subclass each plane makes)."""

    plane: ControlPlane

    def log_message(self, *args: Any) -> None:  # the operator polls; keep the trainer's log clean
        pass

    def _send(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the poller gave up waiting
            self.wfile.write(data)

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.plane.token}".encode()):
            return True
        self._send(401, {"error": "Unauthorized: send Authorization: Bearer <control-plane token>"})
        return False

    def _routed(self, method: str) -> bool:
        """A request under the extra routes' prefix: answered by them (True), after the token check."""
        routes = self.plane.routes
        path = self.path.split("?")[0]
        if routes is None or not (path == routes.prefix or path.startswith(routes.prefix + "/")):
            return False
        if not self._authorized():
            return True
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._send(413, {"error": f"request body over {MAX_BODY} bytes"})
            return True
        body = self.rfile.read(length) if length > 0 else b""
        self._send(*routes.handle(method, self.path, body))
        return True

    def do_POST(self) -> None:
        if not self._routed("POST"):
            self._send(404, {"error": f"no route POST {self.path}"})

    def do_DELETE(self) -> None:
        if not self._routed("DELETE"):
            self._send(404, {"error": f"no route DELETE {self.path}"})

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(200, "ok")
            return
        if self._routed("GET"):
            return
        if self.path.split("?")[0] != "/status":
            self._send(404, {"error": f"no route {self.path}: GET /status or /healthz"})
            return
        if not self._authorized():
            return
        snapshot = self.plane.progress.snapshot()
        self._send(200, snapshot)
        if snapshot.get("phase") in FINAL_PHASES:
            self.wfile.flush()
            self.plane.final_read.set()  # the whole answer is written: linger() may stop the server now


class ControlPlane:
    def __init__(self, progress: Progress, token: str, port: int = CONTROL_PORT, host: str | None = None,
                 routes: Routes | None = None):
        self.progress, self.token, self.routes = progress, token, routes
        self.final_read = threading.Event()  # set once an authorized GET /status returned a final phase
        host = host or ControlEnv.from_env(only=("host",)).host or "127.0.0.1"
        self.server = ThreadingHTTPServer((host, port), type("Handler", (_Handler,), {"plane": self}))
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
