"""Helpers for runtime-Ray tests: a real local Ray head (hack/localray.py), the operator set up to
submit to it (the scripted stand-in trainer, tests/scripted_trainer.py, or the real one), and the Ray
jobs — and processes — a LoRATrainingJob made. Shared by tests/integration (conftest.py) and tests/e2e."""

from __future__ import annotations

import contextlib
import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from localcluster import LocalCluster, pid_alive, wait_for
from localray import LocalRay, tagged_pids
from operatorkit import Operator, apply, get
from specs import valid_job

TESTS = Path(__file__).resolve().parent
LOGS = Path("/tmp/kora-logs")
SCRIPTED_TRAINER = f"{sys.executable} {TESTS / 'scripted_trainer.py'}"
# the real trainer, one torch thread per process (the machine has 2 cores, shared)
REAL_TRAINER = f"{sys.executable} -m kora_trainer.train --threads 1"


@contextlib.contextmanager
def ray_head(cwd: Path, num_cpus: int = 1, env: dict[str, str] | None = None) -> Iterator[LocalRay]:
    """A local Ray head whose jobs run in `cwd`; stopped by its pids after, leaving no process behind."""
    h = LocalRay.start(num_cpus=num_cpus, cwd=cwd, env=env)
    try:
        yield h
    finally:
        h.stop()
    assert h.leftovers() == []


def operator_env(head: LocalRay, port: int, trainer_command: str = SCRIPTED_TRAINER,
                 poll_interval: float = 1) -> dict[str, str]:
    """What an operator needs to submit to `head`: its token, the trainer command, a fast poll, and
    the one control-plane port the test knows (so it can talk to the trainer too)."""
    return {"RAY_AUTH_TOKEN": head.token, "KORA_TRAINER_COMMAND": trainer_command,
            "KORA_POLL_INTERVAL": str(poll_interval), "KORA_RAY_CONTROL_PORTS": f"{port}-{port}"}


@contextlib.contextmanager
def ray_operator(cluster: LocalCluster, ns: str, head: LocalRay, port: int,
                 trainer_command: str = SCRIPTED_TRAINER) -> Iterator[Operator]:
    """`kora operator` for namespace `ns`, submitting `trainer_command` to `head`; log in /tmp/kora-logs."""
    env = operator_env(head, port, trainer_command)
    with Operator(cluster, [ns], LOGS / f"operator-{ns}.log", env=env).running() as op:
        yield op


def ray_job_doc(name: str, home: Path, address: str, script: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """A runtime-Ray LoRATrainingJob whose model.path is `home`, where the scripted trainer finds
    `script.json` and leaves its traces."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "script.json").write_text(json.dumps(script))
    doc = valid_job(name, **spec)
    doc["spec"]["model"] = {"path": str(home)}
    doc["spec"]["runtime"] = {"kind": "Ray", "address": address}
    doc["spec"]["resources"] = {"workers": 0, "gpusPerWorker": 0}
    return doc


def submissions_by_uid(head: LocalRay) -> dict[str, dict[str, dict[str, Any]]]:
    """Every Ray job on `head` that a LoRATrainingJob submitted: by the job's uid (the submission's metadata
    kora.dev/uid), then by submission id."""
    req = urllib.request.Request(f"{head.dashboard_url}/api/jobs/", headers={"Authorization": f"Bearer {head.token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        jobs = json.loads(r.read())
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for j in jobs:
        uid = (j.get("metadata") or {}).get("kora.dev/uid")
        if uid:
            out.setdefault(uid, {})[j["submission_id"]] = j
    return out


def submissions(head: LocalRay, uid: str) -> dict[str, dict[str, Any]]:
    """The Ray jobs the LoRATrainingJob with `uid` submitted, by submission id."""
    return submissions_by_uid(head).get(uid, {})


def pids(home: Path) -> list[int]:
    path = home / "pids"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def attempt(home: Path, n: int) -> dict[str, Any]:
    return dict(json.loads((home / f"attempt-{n}.json").read_text()))


def job_processes(head: LocalRay, job_name: str) -> list[int]:
    """Processes of this Ray head that run for the job (the submission's KORA_JOB_NAME in their environment)."""
    needle = f"KORA_JOB_NAME={job_name}".encode()
    out = []
    for pid in tagged_pids(head.tag):
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                out.append(pid)
    return out


def uid_of(cluster: LocalCluster, name: str, ns: str) -> str:
    return str(wait_for(lambda: (get(cluster, "ltj", name, ns) or {}).get("metadata", {}).get("uid"), timeout=30,
                        what=f"ltj {name}"))


def delete_job(cluster: LocalCluster, name: str, ns: str, timeout: int = 90) -> None:
    cluster.kubectl("delete", "ltj", name, "-n", ns, "--ignore-not-found", "--wait=true", f"--timeout={timeout}s")


@contextlib.contextmanager
def applied(cluster: LocalCluster, doc: dict[str, Any], ns: str) -> Iterator[str]:
    """Apply the job, yield its uid; delete it (stopping its Ray job) afterwards."""
    apply(cluster, doc, ns)
    try:
        yield uid_of(cluster, doc["metadata"]["name"], ns)
    finally:
        delete_job(cluster, doc["metadata"]["name"], ns)


def all_dead(ps: list[int]) -> bool:
    return not any(pid_alive(p) for p in ps)


def cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    return []


def trainer_drivers(head: LocalRay, job_name: str) -> list[int]:
    """The job's `python -m kora_trainer.train` driver processes on this head (not the `sh -c` around them):
    found among this head's tagged processes by the job's KORA_JOB_NAME, never by a name on the machine."""
    return [p for p in job_processes(head, job_name) if cmdline(p)[1:3] == ["-m", "kora_trainer.train"]]


def ray_job_logs(head: LocalRay, sub: str) -> str:
    """The driver's output of Ray job `sub` (the Jobs API's GET /api/jobs/<id>/logs)."""
    req = urllib.request.Request(f"{head.dashboard_url}/api/jobs/{sub}/logs",
                                 headers={"Authorization": f"Bearer {head.token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return str(json.loads(r.read())["logs"])


def trainer_status(port: int, token: str) -> dict[str, Any] | None:
    """One GET /status of the trainer's control plane on 127.0.0.1:`port`; None when it does not answer.
    Mind that a read of a final phase ends the trainer's linger (KORA_CONTROL_LINGER_S)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/status", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return dict(json.loads(r.read()))
    except OSError:
        return None
