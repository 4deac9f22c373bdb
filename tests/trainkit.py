"""Run `python -m kora_trainer.train` as a user does, from tests: `TrainRun` starts it in its own session (so a
kill reaches everything it started), polls its control plane, reads its summary; `wait_all` waits, bounded.
Shared by the trainer's e2e tests (tests/e2e) and the GPU ones (tests/gpu/test_train_megatron.py).

Runs use the toy (tests/conftest.py's `toy_dir`) with TINY steps, scored by tests/e2e/toy_rewards.py.
"""

from __future__ import annotations

import contextlib
import http.client
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
from collections.abc import Callable
from pathlib import Path

import pytest

from kora_trainer.recorder import read_events
from kora_trainer.wire.ports import free_port

REPO = Path(__file__).resolve().parents[1]
E2E = REPO / "tests" / "e2e"  # toy_rewards.py: the runs' custom reward
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
    except (urllib.error.URLError, OSError, http.client.HTTPException):  # not up yet, or exiting
        return None


def train_command(toy_dir: Path, port: int, run_dir: Path, *overrides: str, config: Path = TOY_YAML,
                  base: list[str] | None = None) -> list[str]:
    """`base`: the overrides before the test's own (default: the LLM toy's paths and TINY)."""
    first = base if base is not None else [f"model.path={toy_dir}", f"data.path={toy_dir}/train.parquet", *TINY]
    return [sys.executable, "-m", "kora_trainer.train", "--config", str(config), "--control-port", str(port),
            "--run-dir", str(run_dir), *first, *overrides]


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

    def __init__(self, toy_dir: Path, work: Path, *overrides: str, env: dict[str, str] | None = None,
                 config: Path = TOY_YAML, base: list[str] | None = None):
        work.mkdir(parents=True, exist_ok=True)
        self.port, self.token, self.log, self.run_dir = free_port(), "test-token", work / "out.log", work / "run"
        cmd = train_command(toy_dir, self.port, self.run_dir, *overrides, config=config, base=base)
        # the Ray workers of a local cluster inherit the driver's environment, PYTHONPATH included
        full_env = {**os.environ, "KORA_CONTROL_TOKEN": self.token,
                    "PYTHONPATH": os.pathsep.join([str(E2E), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
                    **(env or {})}
        # not this test process's cluster or process group (a megatron test earlier in the session sets
        # MASTER_PORT in os.environ, and the trainer's own group would then find that port taken)
        for inherited in ("RAY_ADDRESS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            full_env.pop(inherited, None)
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

    def events(self, kind: str | None = None) -> list[dict]:
        """The run's event file (recorder.py), all of it or the events of one kind."""
        return [e for e in read_events(self.run_dir) if kind is None or e["event"] == kind]

    def steps(self) -> list[int]:
        return [e["step"] for e in self.events("step")]

    def notes(self) -> list[str]:
        """What each sync said of its path (the first push and every step's)."""
        syncs = [e["sync"] for e in self.events() if e["event"] in ("start", "step")]
        return [s["note"] for s in syncs if s.get("note")]

    def summary(self) -> dict:
        out = self.output
        lines = [line for line in out.splitlines() if line.startswith('{"event": "summary"')]
        assert self.proc.returncode == 0 and lines, f"exit {self.proc.returncode}:\n{out[-3000:]}"
        summary = json.loads(lines[-1])
        assert self.events("summary") == [summary], "the event file's summary is not the printed one"
        return summary


def wait_all(runs: list[TrainRun], timeout_s: float = TIMEOUT_S, poll: bool = True,
             each: Callable[[TrainRun], None] | None = None) -> None:
    """Wait (bounded) for every run to exit, polling their control planes meanwhile (and calling `each` on a
    running one after its poll); kill them on timeout."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(r.running() for r in runs) and time.monotonic() < deadline:
            for r in runs:
                if poll and r.running():
                    r.poll()
                    if each is not None:
                        each(r)
            time.sleep(0.3)
        late = [r for r in runs if r.running()]
        if late:
            pytest.fail(f"train did not finish in {timeout_s:.0f}s:\n{late[0].output[-3000:]}")
    finally:
        for r in runs:
            if r.running():
                r.kill()


def hang_notice_s(run: TrainRun, engine_log: Path) -> float:
    """Wait for `run` to exit (wait_all); the seconds from its engine's own hang mark in `engine_log` (the test-only
    fault of kora_engine/faults.py) to the first poll that saw the run Failed."""
    from kora_engine.faults import HANG_MARK

    seen: dict[str, float] = {}

    def timed(r: TrainRun) -> None:
        if "hung" not in seen and engine_log.is_file() and HANG_MARK in engine_log.read_text(errors="replace"):
            seen["hung"] = time.monotonic()
        if "failed" not in seen and r.seen and r.seen[-1].get("phase") == "Failed":
            seen["failed"] = time.monotonic()

    wait_all([run], each=timed)
    assert "hung" in seen and "failed" in seen, (seen, run.output[-2000:])
    return seen["failed"] - seen["hung"]
