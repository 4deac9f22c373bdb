"""The control-plane API the operator polls: bearer auth, the Progress shape, the last sync."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest

from kora_operator.api.job import LoRATrainingJob
from kora_operator.api.status import Progress as OperatorProgress
from kora_operator.builders.rayjob import build_ray_job
from kora_operator.progress import read_status
from kora_operator.runtimes import ray as rt
from kora_trainer.config.control import CONTROL_PORT, ControlEnv
from kora_trainer.config.status import MAX_MESSAGE, TrainerStatus, rfc3339
from kora_trainer.control_plane import ControlPlane, Progress, resolve_linger, resolve_port, resolve_token
from localcluster import wait_for
from specs import valid_job


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


def test_the_answer_is_the_shared_model_both_sides_read(plane):
    cp, progress = plane
    progress.record_sync({"mode": "Adapter", "bytes": 1, "ms": 2.0, "adapter_version": 3, "checksum": "c",
                          "pushed": True}, step=3)
    progress.update(step=3, phase="Failed", message="x" * 5000)
    _, body = get(f"{cp.url}/status", "s3cret")
    assert list(body) == [f.alias for f in TrainerStatus.model_fields.values()]  # every key, in the model's order
    parsed = read_status(body)  # the operator's reading
    assert parsed == TrainerStatus.model_validate(body) and parsed.synced_step == 3 and parsed.phase == "Failed"
    assert len(body["message"]) == MAX_MESSAGE and body["lastSync"]["time"].endswith("Z")
    with pytest.raises(TypeError, match="no /status field"):
        progress.update(reward_mean=1.0)  # the JSON names only: a typo fails the writer, not the reader


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


def _trainer_env(monkeypatch, env: dict[str, str]) -> None:
    for field in ControlEnv.model_fields:
        monkeypatch.delenv(ControlEnv.env_name(field), raising=False)
    for name, value in env.items():
        if name.startswith("KORA_CONTROL_"):
            monkeypatch.setenv(name, value)


def test_the_trainer_reads_the_control_env_the_operator_writes(tmp_path, monkeypatch):
    doc = valid_job("toy", runtime={"kind": "Ray", "address": "http://127.0.0.1:8265"})
    doc["metadata"].update(namespace="team-a", uid="u-1")
    body = rt.build_submission(LoRATrainingJob.model_validate(doc), sub="s", token="tok", port=0,
                               trainer_command=["x"], linger_s=15)
    _trainer_env(monkeypatch, body["runtime_env"]["env_vars"])
    assert resolve_token(tmp_path) == ("tok", "env KORA_CONTROL_TOKEN")
    assert resolve_port(None) == 0 and resolve_port(9000) == 9000 and resolve_linger() == (15.0, None)
    cp = ControlPlane(Progress(1, "Merge"), "tok", resolve_port(None))
    try:
        assert cp.server.server_address[0] == "127.0.0.1"
    finally:
        cp.server.server_close()
    # a KubeRay head: the token from the mounted Secret, the fixed port, every interface
    (head,) = build_ray_job(LoRATrainingJob.model_validate(doc))["spec"]["rayClusterSpec"]["headGroupSpec"][
        "template"]["spec"]["containers"]
    written = {e["name"]: e["value"] for e in head["env"] if "value" in e}  # the engine key is a secretKeyRef
    assert ControlEnv.from_env(written) == ControlEnv(port=CONTROL_PORT, token_file="/var/run/secrets/kora/token",
                                                      host="0.0.0.0", linger_s=30)
    _trainer_env(monkeypatch, {})
    assert resolve_port(None) == CONTROL_PORT and resolve_linger() == (0.0, None)


def test_status_says_where_a_run_resumed_from(plane):
    cp, progress = plane
    assert get(f"{cp.url}/status", "s3cret")[1]["resumedFromStep"] is None  # a fresh start
    progress.update(resumedFromStep=4, step=4, lastCheckpoint={"path": "/ckpt/step_00000004", "step": 4})
    body = get(f"{cp.url}/status", "s3cret")[1]
    assert body["resumedFromStep"] == 4
    assert body["lastCheckpoint"] == {"path": "/ckpt/step_00000004", "step": 4, "time": None}  # time: not given
    assert OperatorProgress.model_validate({"lastCheckpoint": body["lastCheckpoint"]}).last_checkpoint.step == 4


class _WaitSeen(threading.Event):
    """`ControlPlane.final_read` that also tells when linger() has started waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def _count_handled(cp: ControlPlane) -> list[str]:
    """One entry per request the server has handled to the end (its handler has returned)."""
    handled: list[str] = []
    finish = cp.server.finish_request

    def counted(request, client_address) -> None:
        try:
            finish(request, client_address)
        finally:
            handled.append("done")

    cp.server.finish_request = counted  # type: ignore[method-assign]
    return handled


def _linger_in_thread(cp: ControlPlane, seconds: float) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        out["read"] = cp.linger(seconds)
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("final", ["Succeeded", "Failed"])
def test_linger_ends_when_an_authorized_status_read_saw_the_final_phase(final):
    progress = Progress(total_steps=3, sync_mode="Merge")
    cp = ControlPlane(progress, "s3cret", port=0, host="127.0.0.1")
    cp.final_read = seen = _WaitSeen()
    handled = _count_handled(cp)
    cp.start()
    try:
        progress.update(phase="Running", step=3)
        assert get(f"{cp.url}/status", "s3cret")[1]["phase"] == "Running"  # not final: does not count
        progress.update(phase=final)
        thread, out = _linger_in_thread(cp, 60.0)
        assert seen.waiting.wait(10)
        assert thread.is_alive()  # still serving, waiting for the operator's read
        wait_for(lambda: len(handled) == 1, timeout=10, interval=0.01, what="the Running read handled to the end")
        assert get(f"{cp.url}/status")[0] == 401 and get(f"{cp.url}/status", "wrong")[0] == 401  # do not count
        assert get(f"{cp.url}/healthz") == (200, "ok")  # does not count either
        wait_for(lambda: len(handled) == 4, timeout=10, interval=0.01, what="the three reads handled to the end")
        assert thread.is_alive() and not seen.is_set()
        code, body = get(f"{cp.url}/status", "s3cret")
        assert code == 200 and body["phase"] == final
        thread.join(timeout=10)
        assert not thread.is_alive() and out["read"] is True and out["s"] < 10
    finally:
        cp.stop()
    with pytest.raises(urllib.error.URLError):  # stopped: nothing listens any more
        urllib.request.urlopen(f"{cp.url}/healthz", timeout=2)


def test_linger_gives_up_after_its_time_and_counts_an_earlier_read():
    progress = Progress(total_steps=3, sync_mode="Merge")
    cp = ControlPlane(progress, "s3cret", port=0, host="127.0.0.1").start()
    try:
        progress.update(phase="Succeeded")
        t0 = time.monotonic()
        assert cp.linger(0.5) is False  # nobody read it
        assert 0.45 <= time.monotonic() - t0 < 5
        assert cp.linger(0) is False
        assert get(f"{cp.url}/status", "s3cret")[1]["phase"] == "Succeeded"
        t0 = time.monotonic()
        assert cp.linger(60) is True and time.monotonic() - t0 < 1  # the final phase was already read
    finally:
        cp.stop()


def test_linger_seconds_from_the_environment(monkeypatch):
    monkeypatch.delenv("KORA_CONTROL_LINGER_S", raising=False)
    assert resolve_linger() == (0.0, None)
    monkeypatch.setenv("KORA_CONTROL_LINGER_S", "12.5")
    assert resolve_linger() == (12.5, None)
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv("KORA_CONTROL_LINGER_S", bad)
        seconds, warning = resolve_linger()
        assert seconds == 0.0 and "KORA_CONTROL_LINGER_S" in warning


def scrape(url: str) -> tuple[str, dict[str, float]]:
    """GET /metrics without a token, parsed by prometheus_client's own text parser: (content type, samples)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        kind, text = resp.headers["Content-Type"], resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return kind, samples


def test_metrics_is_open_and_mirrors_status(plane):
    """/metrics needs no token (like /healthz: numbers only; a PodMonitor cannot hold every job's token) and
    says what /status says, read from the same progress at scrape time."""
    cp, progress = plane
    kind, before = scrape(cp.url)
    assert kind.startswith("text/plain") and "version=" in kind
    assert before["kora_trainer_step"] == 0 and before["kora_trainer_total_steps"] == 20
    assert before["kora_trainer_phase{phase=Starting}"] == 1 and before["kora_trainer_phase{phase=Running}"] == 0
    # what the run does not have yet is left out, not exported as 0
    assert not {"kora_trainer_checkpoint_age_seconds", "kora_trainer_logp_gap_max", "kora_trainer_reward_mean",
                "kora_trainer_last_sync_bytes"} & set(before)
    progress.record_sync({"mode": "Adapter", "bytes": 4096, "ms": 12.5, "adapter_version": 7, "checksum": "c",
                          "pushed": True}, step=7)
    written = datetime.now(UTC) - timedelta(seconds=30)
    progress.update(step=7, rewardMean=0.625, phase="Running", secondsPerStep=0.5, estimatedRemainingSeconds=7,
                    eta="7s", lastCheckpoint={"path": "/ckpt/step_7", "step": 7, "time": rfc3339(written)},
                    servingCheck={"logpGapMax": 3e-6, "logpGapMean": 1e-7, "version": 6, "step": 7})
    _, after = scrape(cp.url)
    assert after["kora_trainer_step"] == 7 and after["kora_trainer_reward_mean"] == 0.625
    assert after["kora_trainer_last_sync_bytes"] == 4096 and after["kora_trainer_last_sync_milliseconds"] == 12.5
    assert after["kora_trainer_last_sync_adapter_version"] == 7 and after["kora_trainer_synced_step"] == 7
    assert after["kora_trainer_logp_gap_max"] == 3e-6 and after["kora_trainer_logp_gap_mean"] == 1e-7
    assert after["kora_trainer_checkpoint_step"] == 7 and 29 <= after["kora_trainer_checkpoint_age_seconds"] < 90
    assert after["kora_trainer_seconds_per_step"] == 0.5 and after["kora_trainer_estimated_remaining_seconds"] == 7
    assert after["kora_trainer_phase{phase=Running}"] == 1 and after["kora_trainer_phase{phase=Starting}"] == 0
    assert get(f"{cp.url}/status")[0] == 401  # /status stays behind the token
    assert _post(f"{cp.url}/metrics") == 405  # read-only


def _post(url: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST"), timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_eta_from_the_measured_step_rate():
    """The ETA the recorder puts on /status: the mean wall time of the last RATE_WINDOW steps x the steps left."""
    from kora_trainer.recorder import RATE_WINDOW, StepRate, human_duration

    rate = StepRate()
    assert rate.progress(0, 10) == {} and rate.tick() is None  # no step timed yet: no ETA
    rate.start()
    took = rate.tick()
    assert took is not None and took >= 0
    got = rate.progress(1, 10)
    assert got["estimatedRemainingSeconds"] == round(9 * got["secondsPerStep"]) and got["eta"].endswith("s")
    rate._durations.extend([2.0] * RATE_WINDOW)  # a steady 2 s per step: the warm-up step has aged out
    assert rate.progress(5, 605) == {"secondsPerStep": 2.0, "estimatedRemainingSeconds": 1200, "eta": "20m00s"}
    assert rate.progress(605, 605)["estimatedRemainingSeconds"] == 0
    assert [human_duration(x) for x in (0, 59.4, 61, 3725, 2 * 86400 + 3 * 3600)] == ["0s", "59s", "1m01s", "1h02m",
                                                                                      "2d03h"]
