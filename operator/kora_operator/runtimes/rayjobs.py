"""A small client of the Ray Jobs REST API (the Ray dashboard's /api/jobs/), over plain HTTP.

The operator imports no Ray: these four calls are all it needs (Ray 2.x dashboard, job_head.py):
  POST /api/jobs/                      {"entrypoint", "submission_id", "runtime_env", "metadata"}
  GET  /api/jobs/{submission_id}       JobDetails: status PENDING|RUNNING|STOPPED|SUCCEEDED|FAILED, message, ...
  POST /api/jobs/{submission_id}/stop  {"stopped": bool}
  GET  /api/version
A Ray cluster with token authentication (RAY_AUTH_MODE=token, the default for new local clusters
since Ray 2.5x) wants `Authorization: Bearer <token>`: the operator finds the token as Ray's own
CLI does ($RAY_AUTH_TOKEN, the file $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token).
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kora_trainer.config.status import rfc3339

PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED = "PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED"
TERMINAL = frozenset({STOPPED, SUCCEEDED, FAILED})
SUBMIT_TIMEOUT = 30.0


class RayError(Exception):
    """The Ray Jobs API could not be used; the message says why and what to do."""


class RayUnavailable(RayError):
    """Not reachable (refused, timed out) or answering 5xx: try again later."""


class RayUnauthorized(RayError):
    """401/403: the operator lacks the Ray cluster's auth token."""


class RayRejected(RayError):
    """4xx other than auth: the request itself is wrong."""


def ray_auth_token(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    if env.get("RAY_AUTH_TOKEN"):
        return env["RAY_AUTH_TOKEN"].strip()
    path = Path(env["RAY_AUTH_TOKEN_PATH"]) if env.get("RAY_AUTH_TOKEN_PATH") else Path.home() / ".ray/auth_token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _ms_to_rfc3339(ms: Any) -> str | None:
    if not isinstance(ms, int | float) or ms <= 0:
        return None
    return rfc3339(dt.datetime.fromtimestamp(ms / 1000, dt.UTC))


@dataclass(frozen=True)
class JobInfo:
    """The parts of Ray's JobDetails the operator reads."""

    submission_id: str
    status: str
    message: str = ""
    start_time: str | None = None  # RFC 3339
    end_time: str | None = None
    driver_exit_code: int | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobInfo:
        code = data.get("driver_exit_code")
        return cls(
            submission_id=str(data.get("submission_id") or ""),
            status=str(data.get("status") or ""),
            message=str(data.get("message") or ""),
            start_time=_ms_to_rfc3339(data.get("start_time")),
            end_time=_ms_to_rfc3339(data.get("end_time")),
            driver_exit_code=int(code) if isinstance(code, int) else None,
            metadata={str(k): str(v) for k, v in (data.get("metadata") or {}).items()},
        )


class RayJobsClient:
    def __init__(self, address: str, token: str | None = None, timeout: float = 3.0) -> None:
        self.address = address.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None,
              timeout: float | None = None) -> tuple[int, bytes]:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.address + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as e:
            text = e.read()
            if e.code in (401, 403):
                hint = ("set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) for the operator to the Ray cluster's token"
                        if not self.token else "the operator's RAY_AUTH_TOKEN is not this Ray cluster's token")
                raise RayUnauthorized(f"the Ray Jobs API at {self.address} answered {e.code} {e.reason}: "
                                      f"{hint}") from None
            if e.code >= 500 and b"already exists" not in text:
                raise RayUnavailable(f"the Ray Jobs API at {self.address} answered {e.code}: "
                                     f"{_last_line(text)}") from None
            return int(e.code), text
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # HTTPException: an answer cut short
            reason = getattr(e, "reason", e)
            raise RayUnavailable(f"cannot reach the Ray Jobs API at {self.address}: {reason}") from None

    def version(self) -> dict[str, Any]:
        code, text = self._call("GET", "/api/version")
        if code != 200:
            raise RayRejected(f"GET {self.address}/api/version answered {code}: {_last_line(text)}")
        return dict(json.loads(text))

    def get(self, submission_id: str) -> JobInfo | None:
        code, text = self._call("GET", f"/api/jobs/{quote(submission_id, safe='')}")
        if code == 404:
            return None
        if code != 200:
            raise RayRejected(f"GET job {submission_id} answered {code}: {_last_line(text)}")
        return JobInfo.from_json(json.loads(text))

    def submit(self, request: Mapping[str, Any]) -> bool:
        """POST the submission; False if one with its submission_id exists already (ours, from before).

        Ray starts its job agent on the first submission, which takes seconds: a longer timeout. If it
        expires anyway the job may still have been made; the next GET of its deterministic id says."""
        code, text = self._call("POST", "/api/jobs/", request, timeout=max(self.timeout, SUBMIT_TIMEOUT))
        if code == 200:
            return True
        if b"already exists" in text:
            return False
        raise RayRejected(f"the Ray Jobs API at {self.address} rejected submission "
                          f"{request.get('submission_id')}: {code} {_last_line(text)}")

    def stop(self, submission_id: str) -> bool:
        """Ask Ray to stop the job (SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S); False if it
        had ended already or does not exist."""
        code, text = self._call("POST", f"/api/jobs/{quote(submission_id, safe='')}/stop", {})
        if code == 404:
            return False
        if code != 200:
            raise RayRejected(f"stopping Ray job {submission_id} answered {code}: {_last_line(text)}")
        return bool(json.loads(text).get("stopped"))


def _last_line(text: bytes) -> str:
    lines = [ln for ln in text.decode(errors="replace").splitlines() if ln.strip() and ln.strip() != "."]
    return lines[-1].strip()[:300] if lines else "(empty answer)"
