"""`python -m kora_trainer.train` end to end, as a user runs it: real local Ray, a real engine process,
real gloo / in-memory weight sync, the control plane polled over HTTP while the job runs. A short run on a
toy made in a temp dir (no pretraining: this checks the pipeline, not the learning curve — the full toy
curves are measured by the command in trainer/examples/toy.yaml), scored by a custom reward (toy_rewards.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kora_trainer.sync.group import free_port

REPO = Path(__file__).resolve().parents[2]
TOY_YAML = REPO / "trainer" / "examples" / "toy.yaml"
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    from kora_trainer.toy import make_toy

    out = tmp_path_factory.mktemp("toy") / "toy"
    make_toy(out, target=0.0)  # untrained: the pipeline is under test here
    return out


def poll_status(port: int, token: str) -> dict | None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/status", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError):
        return None


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "deployment"), [("Adapter", "Disaggregated"), ("Merge", "Colocate"),
                                                  ("EngineMerge", "Disaggregated")])
def test_train_command_runs_and_reports(toy_dir, tmp_path, mode, deployment):
    port, token = free_port(), "test-token"
    cmd = [sys.executable, "-m", "kora_trainer.train", "--config", str(TOY_YAML), "--control-port", str(port),
           "--run-dir", str(tmp_path / "run"), f"model.path={toy_dir}", f"data.path={toy_dir}/train.parquet",
           f"lora.syncMode={mode}", f"deployment.mode={deployment}", "algorithm.numSteps=3",
           "algorithm.rolloutBatchSize=8", "algorithm.nSamplesPerPrompt=4", "algorithm.globalBatchSize=16",
           "sync.bufferSize=256Ki",
           "data.rewardType=custom", "data.customRewardPath=toy_rewards.odd_first_digit"]
    # the Ray workers of a local cluster inherit the driver's environment, PYTHONPATH included
    env = {**os.environ, "KORA_CONTROL_TOKEN": token,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    with open(tmp_path / "out.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    seen: list[dict] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            status = poll_status(port, token)
            if status is not None:
                seen.append(status)
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
            pytest.fail(f"train did not finish in {TIMEOUT_S}s:\n{(tmp_path / 'out.log').read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    out = (tmp_path / "out.log").read_text()
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads([line for line in out.splitlines() if line.startswith('{"event": "summary"')][-1])
    assert summary["steps"] == 3 and summary["sync_mode"] == mode
    assert summary["transport"] == ("colocated" if deployment == "Colocate" else "distributed")
    assert summary["sync_bytes_per_step"] > 0 and summary["sync_ms_p50"] > 0
    assert {"reward_first", "reward_last", "wall_s"} <= set(summary)
    # the operator's view while it ran: progress moved and every sync was reported with its version
    running = [s for s in seen if s["phase"] == "Running"]
    assert running, f"the control plane never answered while the job ran ({len(seen)} polls)"
    last = running[-1]
    assert last["totalSteps"] == 3 and last["syncMode"] == mode and last["lastSync"]["checksum"]
    assert last["lastSync"]["adapterVersion"] <= last["step"]
    assert "step 3/3" in out
    assert last.get("syncedStep") is not None and last["syncedStep"] >= last["lastSync"]["adapterVersion"]
