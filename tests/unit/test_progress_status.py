"""Progress, the pure parts and the one HTTP call: a trainer's /status answer into status.progress and
the WeightsSynced / Checkpointed conditions; fetched from the trainer's REAL control-plane server."""

from __future__ import annotations

import socket
import threading

import pytest

from kora_operator.api.job import LoRATrainingJob
from kora_operator.conditions import transitions
from kora_operator.progress import ProgressUnavailable, fetch, progress_conditions, progress_of
from kora_operator.runtimes import kuberay
from kora_trainer.control_plane import ControlPlane, Progress
from specs import valid_job

SNAPSHOT = {
    "step": 7, "totalSteps": 20, "rewardMean": 0.42,
    "lastSync": {"mode": "Adapter", "bytes": 1 << 20, "milliseconds": 35.2, "adapterVersion": 7, "checksum": "ab12",
                 "time": "2026-11-30T10:00:00Z"},
    "lastCheckpoint": {"path": "/ckpt/step_5", "step": 5},
    "phase": "Running", "syncMode": "Adapter", "message": "",
}


def spec(**kw):
    return LoRATrainingJob.model_validate(valid_job("p", **kw)).spec


def by_type(conds):
    return {str(c.type): c for c in conds}


def test_progress_keeps_the_model_keys_only():
    got = progress_of(SNAPSHOT)
    assert set(got) == {"step", "totalSteps", "rewardMean", "lastSync", "lastCheckpoint"}
    assert got["lastSync"] == SNAPSHOT["lastSync"] and got["lastCheckpoint"] == SNAPSHOT["lastCheckpoint"]
    assert progress_of({"step": 0, "totalSteps": 5, "rewardMean": None, "lastSync": None}) == {"step": 0,
                                                                                               "totalSteps": 5}


def test_a_malformed_answer_is_not_written():
    with pytest.raises(ProgressUnavailable, match="Progress model"):
        progress_of({"step": -1})
    with pytest.raises(ProgressUnavailable):
        progress_of({"lastSync": {"mode": "Sideways"}})


@pytest.mark.parametrize(("step", "version", "stale", "ok"), [
    (7, 7, 1, True), (8, 7, 1, True), (9, 7, 1, False), (9, 7, 2, True), (12, 7, 4, False), (7, 7, 0, True),
    (8, 7, 0, False),
])
def test_weights_synced_compares_the_engines_version_with_max_staleness(step, version, stale, ok):
    snap = {**SNAPSHOT, "step": step, "lastSync": {**SNAPSHOT["lastSync"], "adapterVersion": version}}
    c = by_type(progress_conditions(progress_of(snap), spec(deployment={"maxStaleness": stale})))["WeightsSynced"]
    assert (c.status == "True") is ok
    if not ok:
        assert c.reason == "EnginesBehind" and f"{step - version} steps behind" in c.message
        assert f"maxStaleness {stale}" in c.message


def test_a_skipped_push_is_not_staleness_when_the_trainer_says_so():
    snap = {**SNAPSHOT, "step": 9, "lastSync": {**SNAPSHOT["lastSync"], "adapterVersion": 3}}
    stale = by_type(progress_conditions(progress_of(snap), spec()))["WeightsSynced"]
    assert stale.status == "False"
    checked = by_type(progress_conditions(progress_of(snap), spec(), synced_step=9))["WeightsSynced"]
    assert checked.status == "True" and "unchanged within sync.deltaSkipThreshold up to step 9" in checked.message


def test_a_stale_policy_is_a_warning_event():
    s = spec()
    fresh = progress_conditions(progress_of(SNAPSHOT), s)
    stale = progress_conditions(progress_of({**SNAPSHOT, "step": 10}), s)
    as_dicts = [{"type": str(c.type), "status": c.status, "reason": str(c.reason), "message": c.message}
                for c in fresh]
    news = transitions(as_dicts, [{"type": str(c.type), "status": c.status, "reason": str(c.reason),
                                   "message": c.message} for c in stale])
    assert [(t.type, t.reason) for t in news] == [("Warning", "EnginesBehind")]


def test_no_sync_yet_sets_no_weights_synced():
    assert "WeightsSynced" not in by_type(progress_conditions({"step": 0, "totalSteps": 3}, spec()))


def test_checkpointed():
    with_path = spec(checkpoint={"path": "/ckpt", "interval": 10})
    c = by_type(progress_conditions(progress_of(SNAPSHOT), with_path))["Checkpointed"]
    assert (c.status, c.reason, c.message) == ("True", "Checkpointed", "step 5 saved in /ckpt/step_5")
    c = by_type(progress_conditions({"step": 3}, with_path))["Checkpointed"]
    assert (c.status, c.reason) == ("False", "NoCheckpointYet") and "every 10 steps" in c.message
    c = by_type(progress_conditions({"step": 3}, spec()))["Checkpointed"]
    assert (c.status, c.reason) == ("False", "CheckpointsDisabled")


@pytest.fixture
def server():
    progress = Progress(20, "Adapter")
    cp = ControlPlane(progress, "the-token", 0, host="127.0.0.1").start()
    yield cp, progress
    cp.stop()


def test_fetch_reads_the_real_control_plane(server):
    cp, progress = server
    progress.update(step=3, rewardMean=0.5, phase="Running")
    progress.record_sync({"mode": "Adapter", "bytes": 10, "ms": 1.0, "adapter_version": 3, "checksum": "c",
                          "pushed": True})
    got = progress_of(fetch(cp.url, "the-token", timeout=5))
    assert got["step"] == 3 and got["totalSteps"] == 20 and got["lastSync"]["adapterVersion"] == 3


def test_fetch_with_the_wrong_token_says_so(server):
    cp, _ = server
    with pytest.raises(ProgressUnavailable) as e:
        fetch(cp.url, "another", timeout=5)
    assert e.value.unauthorized and "refused" in str(e.value)


def test_fetch_from_nowhere():
    cp = ControlPlane(Progress(1, "Merge"), "t", 0, host="127.0.0.1").start()
    url = cp.url
    cp.stop()
    with pytest.raises(ProgressUnavailable, match="cannot read") as e:
        fetch(url, "t", timeout=2)
    assert not e.value.unauthorized


def test_an_answer_cut_short_is_unavailable_not_a_crash():
    """A trainer that exits while it writes /status: the headers came, the body did not. The operator's poll
    says the trainer cannot be read (and tries again later) instead of raising http.client's IncompleteRead."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def cut_short() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 705\r\n\r\n")
        t = threading.Thread(target=cut_short, daemon=True)
        t.start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(ProgressUnavailable, match=r"cannot read .*IncompleteRead"):
            fetch(url, "t", timeout=5)
        t.join(timeout=5)


def test_kuberay_control_url_is_the_head_service():
    assert kuberay.control_url({"dashboardURL": "rj-x7k2p-head-svc.team-a.svc.cluster.local:8265"}, "team-a") == \
        "http://rj-x7k2p-head-svc.team-a.svc.cluster.local:8068"
    assert kuberay.control_url({"rayClusterName": "rj-x7k2p"}, "team-a") == "http://rj-x7k2p-head-svc.team-a.svc:8068"
    assert kuberay.control_url({}, "team-a") is None
