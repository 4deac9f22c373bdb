"""The control-plane API the operator polls: bearer auth, the Progress shape, the last sync."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from kora_operator.api.status import Progress as OperatorProgress
from kora_trainer.control_plane import ControlPlane, Progress, resolve_token


def get(url: str, token: str | None = None) -> tuple[int, object]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def plane():
    progress = Progress(total_steps=20, sync_mode="Adapter")
    cp = ControlPlane(progress, "s3cret", port=0, host="127.0.0.1").start()
    yield cp, progress
    cp.stop()


def test_status_needs_the_token(plane):
    cp, _ = plane
    assert get(f"{cp.url}/status")[0] == 401
    assert get(f"{cp.url}/status", "wrong")[0] == 401
    assert get(f"{cp.url}/healthz") == (200, "ok")
    code, body = get(f"{cp.url}/status", "s3cret")
    assert code == 200 and body["phase"] == "Starting" and body["totalSteps"] == 20


def test_status_reports_progress_and_the_last_pushed_sync(plane):
    cp, progress = plane
    report = {"mode": "Adapter", "bytes": 4096, "ms": 12.5, "adapter_version": 7, "checksum": "abc123", "pushed": True}
    progress.record_sync(report, step=7)
    progress.record_sync({**report, "pushed": False, "bytes": 0, "adapter_version": 7}, step=8)  # delta-skipped
    progress.update(step=8, rewardMean=0.625, phase="Running")
    _, body = get(f"{cp.url}/status", "s3cret")
    assert body["step"] == 8 and body["rewardMean"] == 0.625
    assert body["lastSync"]["bytes"] == 4096 and body["lastSync"]["adapterVersion"] == 7
    assert body["lastSync"]["milliseconds"] == 12.5 and body["lastSync"]["checksum"] == "abc123"
    assert body["syncedStep"] == 8  # the skip kept the engines current: not stale although adapterVersion is 7
    # the operator can take the progress keys as they are
    parsed = OperatorProgress.model_validate({k: body[k] for k in
                                              ("step", "totalSteps", "rewardMean", "lastSync", "lastCheckpoint")})
    assert parsed.last_sync.adapter_version == 7 and parsed.step == 8


def test_token_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("KORA_CONTROL_TOKEN", raising=False)
    monkeypatch.delenv("KORA_CONTROL_TOKEN_FILE", raising=False)
    token, _ = resolve_token(tmp_path / "run")
    assert (tmp_path / "run" / "control-token").read_text().strip() == token and len(token) > 20
    assert oct((tmp_path / "run" / "control-token").stat().st_mode & 0o777) == "0o600"
    (tmp_path / "tok").write_text("from-secret\n")
    monkeypatch.setenv("KORA_CONTROL_TOKEN_FILE", str(tmp_path / "tok"))
    assert resolve_token(tmp_path)[0] == "from-secret"
    monkeypatch.setenv("KORA_CONTROL_TOKEN", "from-env")
    assert resolve_token(tmp_path) == ("from-env", "env KORA_CONTROL_TOKEN")
