"""`python -m kora_trainer.train` end to end, as a user runs it: real local Ray, a real engine process,
real gloo / in-memory weight sync, the control plane polled over HTTP while the job runs. A short run on a
toy made in a temp dir (no pretraining: this checks the pipeline, not the learning curve — the full toy
curves are measured by the command in trainer/examples/toy.yaml), scored by a custom reward (toy_rewards.py).

The launch helpers here (`TrainRun`, `train_command`) are shared with the other
e2e tests of the trainer (test_resume.py, test_export.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
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
# small steps on the toy: 8 prompts x 4 samples, one optimizer batch of 16 twice per step
TINY = ["algorithm.rolloutBatchSize=8", "algorithm.nSamplesPerPrompt=4", "algorithm.globalBatchSize=16",
        "sync.bufferSize=256Ki", "data.rewardType=custom", "data.customRewardPath=toy_rewards.odd_first_digit"]



def poll_status(port: int, token: str) -> dict | None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/status", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError):
        return None


def train_command(toy_dir: Path, port: int, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "kora_trainer.train", "--config", str(TOY_YAML), "--control-port", str(port),
            "--run-dir", str(run_dir), f"model.path={toy_dir}", f"data.path={toy_dir}/train.parquet", *TINY,
            *overrides]


def _session_pids(sid: int) -> list[int]:
    """Every live process of session `sid` (the trainer and what it started: Ray, its workers, engines)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # after ")": state ppid pgrp session ...
            pids.append(int(d.name))
    return pids


class TrainRun:
    """One `python -m kora_trainer.train` in its own session (so a kill reaches everything it started),
    its output in `log`, its control plane on `port` with bearer `token`."""

    def __init__(self, toy_dir: Path, work: Path, *overrides: str, env: dict[str, str] | None = None):
        work.mkdir(parents=True, exist_ok=True)
        self.port, self.token, self.log = free_port(), "test-token", work / "out.log"
        cmd = train_command(toy_dir, self.port, work / "run", *overrides)
        # the Ray workers of a local cluster inherit the driver's environment, PYTHONPATH included
        full_env = {**os.environ, "KORA_CONTROL_TOKEN": self.token,
                    "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
                    **(env or {})}
        full_env.pop("RAY_ADDRESS", None)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=work,
                                         start_new_session=True)
        self.seen: list[dict] = []

    def poll(self) -> dict | None:
        status = poll_status(self.port, self.token)
        if status is not None:
            self.seen.append(status)
        return status

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL every process of the run's session, by pid, and remove its private Ray temp dir."""
        sid = self.proc.pid
        pids = _session_pids(sid)
        temp_dirs = set()
        for pid in pids:
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                temp_dirs.update(re.findall(r"/tmp/kora-ray-[A-Za-z0-9_]+", cmdline))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.1)
        for d in temp_dirs:
            shutil.rmtree(d, ignore_errors=True)

    def summary(self) -> dict:
        out = self.output
        lines = [line for line in out.splitlines() if line.startswith('{"event": "summary"')]
        assert self.proc.returncode == 0 and lines, f"exit {self.proc.returncode}:\n{out[-3000:]}"
        return json.loads(lines[-1])


def wait_all(runs: list[TrainRun], timeout_s: float = TIMEOUT_S, poll: bool = True) -> None:
    """Wait (bounded) for every run to exit, polling their control planes meanwhile; kill them on timeout."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(r.running() for r in runs) and time.monotonic() < deadline:
            for r in runs:
                if poll and r.running():
                    r.poll()
            time.sleep(0.3)
        late = [r for r in runs if r.running()]
        if late:
            pytest.fail(f"train did not finish in {timeout_s:.0f}s:\n{late[0].output[-3000:]}")
    finally:
        for r in runs:
            if r.running():
                r.kill()


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "deployment"), [("Adapter", "Disaggregated"), ("Merge", "Colocate"),
                                                  ("EngineMerge", "Disaggregated")])
def test_train_command_runs_and_reports(toy_dir, tmp_path, mode, deployment):
    run = TrainRun(toy_dir, tmp_path, f"lora.syncMode={mode}", f"deployment.mode={deployment}",
                   "algorithm.numSteps=3")
    wait_all([run])
    out = run.output
    summary = run.summary()
    assert summary["steps"] == 3 and summary["sync_mode"] == mode
    assert summary["transport"] == ("colocated" if deployment == "Colocate" else "distributed")
    assert summary["sync_bytes_per_step"] > 0 and summary["sync_ms_p50"] > 0
    assert {"reward_first", "reward_last", "wall_s"} <= set(summary)
    assert len(summary["loss_curve"]) == 3 and summary["first_step"] == 1 and summary["resumed_from_step"] is None
    # the operator's view while it ran: progress moved and every sync was reported with its version
    running = [s for s in run.seen if s["phase"] == "Running"]
    assert running, f"the control plane never answered while the job ran ({len(run.seen)} polls)"
    last = running[-1]
    assert last["totalSteps"] == 3 and last["syncMode"] == mode and last["lastSync"]["checksum"]
    assert last["lastSync"]["adapterVersion"] <= last["step"]
    assert last["resumedFromStep"] is None and last["lastCheckpoint"] is None  # no checkpoint.path: none
    assert "step 3/3" in out
    assert last.get("syncedStep") is not None and last["syncedStep"] >= last["lastSync"]["adapterVersion"]


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 2])
def test_async_rollouts_lag_at_most_max_staleness(toy_dir, tmp_path, max_staleness):
    """deployment.async with maxStaleness k: the engines run up to k steps ahead of training, never more
    (k = 0 turns the overlap off). The lag is what the engines tagged their rollouts with."""
    run = TrainRun(toy_dir, tmp_path, "deployment.async=true", f"deployment.maxStaleness={max_staleness}",
                   "algorithm.numSteps=5")
    wait_all([run], poll=False)
    summary = run.summary()
    assert summary["steps"] == 5
    assert summary["rollout_lag_max"] <= max_staleness
    if max_staleness == 0:
        assert summary["rollout_lag_max"] == 0
