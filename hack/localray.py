#!/usr/bin/env python3
"""A local Ray head on 127.0.0.1 for runtime-Ray jobs (tests, the demo): `ray start --head --block`
in its own session, its own temp dir, free ports, token authentication with its own token, and
one CPU unless told otherwise.

Stopped by the pids it started, never by `ray stop` (which would stop every Ray on the machine,
other people's included): SIGTERM to the `ray start --block` process (it stops its node), then
SIGKILL to whatever is left that carries this head's tag. Every process of the head — GCS,
raylet, dashboard, workers, job drivers and what they start — inherits the environment variable
KORA_LOCAL_RAY=<tag>, so "what is left" is found in /proc without guessing by name.

    python hack/localray.py up      # prints the dashboard URL; state and auth_token in .kora/ray/;
                                    # Ray jobs run in the directory `up` was run in
    python hack/localray.py down
    python hack/localray.py smoke   # a head of its own: one Ray job with one task through the Jobs API, then
                                    # stopped (what tests/e2e/test_loopback_only.py traces)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kora_trainer.config.ray_env import ray_home, single_node_env
from localcluster import free_ports, pid_alive, proc_start_time, wait_for

TAG_ENV = "KORA_LOCAL_RAY"
STATE_DIR = Path(__file__).resolve().parents[1] / ".kora" / "ray"


def tagged_pids(tag: str) -> list[int]:
    """Living processes whose environment carries KORA_LOCAL_RAY=<tag>."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


@dataclass
class LocalRay:
    dashboard_url: str
    gcs_address: str
    token: str
    tag: str
    temp_dir: str
    log: str
    pid: int
    start_time: str | None
    popen: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, num_cpus: int = 1, cwd: Path | None = None, log: Path | None = None,
              timeout: float = 120, env: dict[str, str] | None = None) -> LocalRay:
        gcs, dash, client, agent = free_ports(4)
        tag = secrets.token_hex(8)
        token = secrets.token_hex(32)
        # a short path: Ray's unix sockets live under it and a socket path is limited to 107 bytes
        temp_dir = tempfile.mkdtemp(prefix="kora-rayhead-", dir="/tmp")
        log = log or Path(temp_dir) / "ray-start.log"
        ray = Path(sys.executable).with_name("ray")
        cmd = [str(ray), "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1",
               "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
               f"--dashboard-agent-listen-port={agent}", f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}",
               "--include-dashboard=true", "--disable-usage-stats"]
        full_env = {
            **os.environ, **(env or {}), TAG_ENV: tag,
            # token authentication, with this head's own token (not ~/.ray/auth_token)
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
            # loopback only, no usage report, no cloud metadata probe (each setting's reason: config/ray_env.py);
            # the head's HOME holds the bootstrap config that stops the probe, so jobs run with it too
            **single_node_env(), "HOME": str(ray_home(Path(temp_dir) / "home")),
        }
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as fh:
            popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                     env=full_env, cwd=str(cwd) if cwd else temp_dir, start_new_session=True)
        head = cls(f"http://127.0.0.1:{dash}", f"127.0.0.1:{gcs}", token, tag, temp_dir, str(log), popen.pid,
                   proc_start_time(popen.pid), popen)
        try:
            # done when the Jobs API answers, or when `ray start` gave up (then say why at once)
            wait_for(lambda: popen.poll() is not None or head.ready(), timeout=timeout, interval=0.5,
                     what=f"the Ray head's Jobs API (log {log})")
            if popen.poll() is not None:
                raise RuntimeError(f"`ray start` exited {popen.returncode}; log:\n{Path(log).read_text()[-3000:]}")
        except BaseException:
            head.stop()
            raise
        return head

    def ready(self) -> bool:
        req = urllib.request.Request(f"{self.dashboard_url}/api/version",
                                     headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=2) as r:
            return bool(r.status == 200)

    def env(self) -> dict[str, str]:
        """What a client (the operator, `ray job submit`) needs to use this head."""
        return {"RAY_AUTH_TOKEN": self.token, "RAY_ADDRESS": self.dashboard_url}

    def leftovers(self) -> list[int]:
        return tagged_pids(self.tag)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM the head, wait, SIGKILL every process still tagged as this head's; remove the temp dir."""
        if pid_alive(self.pid, self.start_time):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(self.pid, self.start_time) and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(3):
            left = self.leftovers()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=5)
        left = self.leftovers()
        if left:
            raise RuntimeError(f"Ray processes {left} survived SIGKILL")
        # a Ray process may still have been writing its last logs into the session dir: twice
        for _ in range(2):
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            time.sleep(0.5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def request(self, method: str, path: str, body: dict[str, object] | None = None) -> dict[str, object]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.dashboard_url}{path}", data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return dict(json.loads(r.read()))

    def smoke(self, timeout: float = 120) -> str:
        """Run one Ray job (a driver and a task) through the Jobs API; wait until the dashboard has looked at
        usage stats. Returns the job's final status."""
        entry = f"{sys.executable} -c 'import ray; ray.init(); print(ray.get(ray.remote(lambda: 41 + 1).remote()))'"
        sub = str(self.request("POST", "/api/jobs/", {"entrypoint": entry})["submission_id"])
        status: list[str] = []

        def finished() -> bool:
            status[:] = [str(self.request("GET", f"/api/jobs/{sub}")["status"])]
            return status[0] in ("SUCCEEDED", "FAILED", "STOPPED")

        wait_for(finished, timeout=timeout, interval=0.5, what=f"Ray job {sub}")
        dash_log = Path(self.temp_dir) / "session_latest" / "logs" / "dashboard.log"
        wait_for(lambda: dash_log.exists() and "Usage reporting is" in dash_log.read_text(errors="replace"),
                 timeout=timeout, interval=0.5, what=f"the usage-stats line in {dash_log}")
        return status[0]

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "popen"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["up", "down", "smoke"])
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--state-dir", type=Path, default=STATE_DIR)
    args = p.parse_args(argv)
    state = args.state_dir / "head.json"
    if args.action == "smoke":
        head = LocalRay.start(num_cpus=1)
        try:
            result = head.smoke()
        finally:
            head.stop()
        print(f"Ray job: {result}")
        return 0 if result == "SUCCEEDED" else 1
    if args.action == "up":
        if state.exists():
            head = LocalRay(**json.loads(state.read_text()))
            if pid_alive(head.pid, head.start_time):
                print(head.dashboard_url)
                return 0
        args.state_dir.mkdir(parents=True, exist_ok=True)
        # Ray jobs run in the head's working directory: here, so relative paths in a job (.kora/toy) work
        head = LocalRay.start(num_cpus=args.num_cpus, log=args.state_dir / "ray.log", cwd=Path.cwd())
        state.write_text(json.dumps(head.to_json()))
        (args.state_dir / "auth_token").write_text(head.token)
        os.chmod(args.state_dir / "auth_token", 0o600)
        print(head.dashboard_url)
        return 0
    if state.exists():
        LocalRay(**json.loads(state.read_text())).stop()
        state.unlink()
        (args.state_dir / "auth_token").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
