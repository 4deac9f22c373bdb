"""Helpers for runtime-Ray tests: a real local Ray head (hack/localray.py), the scripted stand-in
trainer (tests/scripted_trainer.py), and the Ray jobs a LoRATrainingJob made."""

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
from operatorkit import apply, get
from specs import valid_job

TESTS = Path(__file__).resolve().parent
SCRIPTED_TRAINER = f"{sys.executable} {TESTS / 'scripted_trainer.py'}"


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


def submissions(head: LocalRay, uid: str) -> dict[str, dict[str, Any]]:
    """The Ray jobs the LoRATrainingJob with `uid` submitted, by submission id."""
    req = urllib.request.Request(f"{head.dashboard_url}/api/jobs/", headers={"Authorization": f"Bearer {head.token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        jobs = json.loads(r.read())
    return {j["submission_id"]: j for j in jobs if (j.get("metadata") or {}).get("kora.dev/uid") == uid}


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
