"""LoRAAdapter: the operator registers each adapter on its job's trainer (POST /adapter_runs), mirrors the trainer's
state of it into its status and `kubectl get lad`, deregisters it when it is deleted, lets the job's deletion take
its adapters with it, and fails an adapter that SPEC rule 9 keeps out of its job, with the fix in the message.

The job runs on a real local Ray head (runtime Ray). Its trainer is tests/scripted_trainer.py in mode "multi": the
REAL control plane with the REAL adapter registry and /adapter_runs routes, and a scripted stand-in for the
trainer's multi-adapter driver (every active adapter steps once per step_seconds). The test reads the registry
back through the same routes, with the job's token, as the operator does.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from kora_operator.tokens import derive_token
from localcluster import wait_for
from operatorkit import TEST_OPERATOR_KEY, apply, events, get, job_status
from raykit import applied, delete_job, ray_job_doc

WAIT = 60
FINALIZER = "kora.dev/deregister-adapter"


def prompts(tmp_path: Path) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n' * 8)
    return data


def adapter(name: str, job: str, path: Path, **spec: Any) -> dict[str, Any]:
    """A LoRAAdapter of `job` on the prompts at `path`."""
    return {"apiVersion": "kora.dev/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": name},
            "spec": {"jobName": job, "rank": 4, "data": {"path": str(path)}, **spec}}


def trainer_state(port: int, token: str) -> dict[str, Any]:
    """GET /adapter_runs/state of the job's trainer (the registry itself, through its routes)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/adapter_runs/state",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return dict(json.loads(r.read()))


@contextmanager
def service(cluster, ns, head, control_port, tmp_path, name, max_adapters=2, **spec) -> Iterator[Callable[[], dict]]:
    """A running multi-adapter job (service mode: no adapters at start); yields a reader of its trainer's state."""
    doc = ray_job_doc(name, tmp_path / name, head.dashboard_url, {"mode": "multi", "num_steps": 4, "step_seconds": 0.3},
                      lora={"rank": 8, "syncMode": "Adapter"}, multiLora={"maxAdapters": max_adapters}, **spec)
    # the sglang-miles build carries multi-LoRA in either deployment (a stock build only Colocate: sglang_builds.py)
    doc["spec"].setdefault("rollout", {}).setdefault("sglangBuild", "sglang-miles-94949da7")
    with applied(cluster, doc, ns) as uid:
        wait_for(lambda: job_status(cluster, name, ns).get("phase") == "Running", timeout=WAIT,
                 what=f"ltj {name} Running")
        token = derive_token(TEST_OPERATOR_KEY.encode(), uid)
        yield lambda: trainer_state(control_port, token)


def lad(cluster, name, ns) -> dict[str, Any]:
    return get(cluster, "lad", name, ns) or {}


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def wait_lad(cluster, name, ns, pred, what) -> dict[str, Any]:
    """The adapter's status once `pred` holds for it."""
    return wait_for(lambda: (s := lad(cluster, name, ns).get("status") or {}) and pred(s) and s, timeout=WAIT,
                    interval=0.2, what=f"lad {name}: {what} (now {lad(cluster, name, ns).get('status')})")


def reasons(cluster, name, ns, *wanting) -> list[tuple[str, str]]:
    return [(e["type"], e["reason"]) for e in events(cluster, name, ns, kind="LoRAAdapter", wanting=wanting)]


def names(state: dict[str, Any]) -> list[str]:
    return [a["name"] for a in state["adapters"]]


def test_an_adapter_registers_trains_and_is_deregistered_when_deleted(cluster, ns, ray_operator, head, control_port,
                                                                     tmp_path):
    data = prompts(tmp_path)
    # applied before its job exists: it waits, and registers once the job runs
    apply(cluster, adapter("early", "svc", data, numSteps=1000), ns)
    s = wait_lad(cluster, "early", ns, lambda s: cond(s, "Registered").get("reason") == "JobNotFound", "JobNotFound")
    assert s["phase"] == "Pending" and "LoRATrainingJob svc does not exist (yet)" in cond(s, "Registered")["message"]
    with service(cluster, ns, head, control_port, tmp_path, "svc") as state:
        s = wait_lad(cluster, "early", ns, lambda s: s.get("phase") == "Training" and s.get("step", 0) >= 2, "step 2")
        assert cond(s, "Registered")["status"] == "True" and s["slot"] == 0 and s["numSteps"] == 1000
        assert cond(s, "Training")["status"] == "True" and cond(s, "WeightsSynced")["status"] == "True"
        head_row, row = cluster.kubectl("get", "lad", "early", "-n", ns).stdout.splitlines()
        assert head_row.split() == ["NAME", "JOB", "PHASE", "STEP", "REWARD", "VERSION", "AGE"]
        name, job, phase, step, reward, version, _ = row.split()
        assert (name, job, phase) == ("early", "svc", "Training")
        assert int(step) >= 2 and float(reward) == int(step) / 1000 and int(version) >= 2, row
        meta = lad(cluster, "early", ns)["metadata"]
        (owner,) = meta["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("LoRATrainingJob", "svc", True)
        assert owner["uid"] == get(cluster, "ltj", "svc", ns)["metadata"]["uid"]
        assert FINALIZER in meta["finalizers"]
        assert names(state()) == ["early"]
        wait_for(lambda: job_status(cluster, "svc", ns).get("progress", {}).get("activeAdapters") == 1, timeout=WAIT,
                 what="progress.activeAdapters 1")

        # two slots: a second adapter takes the other one, a third waits for one to free
        apply(cluster, adapter("second", "svc", data, numSteps=1000), ns)
        apply(cluster, adapter("third", "svc", data, numSteps=1000), ns)
        wait_lad(cluster, "second", ns, lambda s: s.get("phase") == "Training", "Training")
        s = wait_lad(cluster, "third", ns, lambda s: cond(s, "Registered").get("reason") == "NoFreeSlot", "NoFreeSlot")
        assert s["phase"] == "Pending" and "no free slot" in cond(s, "Registered")["message"]
        assert ("Warning", "NoFreeSlot") in reasons(cluster, "third", ns, "NoFreeSlot")
        assert FINALIZER not in (lad(cluster, "third", ns)["metadata"].get("finalizers") or [])
        assert state()["active"] == 2

        # deleted: retired at the trainer's next step boundary, then forgotten there; the delete waits for it
        cluster.kubectl("delete", "lad", "second", "-n", ns, "--wait=true", f"--timeout={WAIT}s")
        assert "second" not in names(state())
        assert ("Normal", "Deregistered") in reasons(cluster, "second", ns, "Deregistered")
        # the freed slot goes to the adapter that waited for one
        s = wait_lad(cluster, "third", ns, lambda s: s.get("phase") == "Training", "Training once a slot freed")
        assert s["slot"] == 1 and names(state()) == ["early", "third"]


def test_an_adapter_succeeds_and_deleting_its_job_deletes_its_adapters(cluster, ns, ray_operator, head, control_port,
                                                                      tmp_path):
    data = prompts(tmp_path)
    with service(cluster, ns, head, control_port, tmp_path, "brief-svc") as state:
        apply(cluster, adapter("brief", "brief-svc", data, numSteps=3), ns)
        apply(cluster, adapter("long", "brief-svc", data, numSteps=1000), ns)
        s = wait_lad(cluster, "brief", ns, lambda s: s.get("phase") == "Succeeded", "Succeeded")
        assert s["step"] == 3 and s["exportPath"] == "/exports/brief" and "slot" not in s
        complete = cond(s, "Complete")
        assert complete["status"] == "True" and "/exports/brief" in complete["message"]
        assert (cond(s, "Training")["status"], cond(s, "Training")["reason"]) == ("False", "Succeeded")
        # the trainer keeps a finished adapter's record until it is deleted: so does the finalizer
        assert FINALIZER in lad(cluster, "brief", ns)["metadata"]["finalizers"]
        (brief,) = [a for a in state()["adapters"] if a["name"] == "brief"]
        assert brief["phase"] == "Succeeded" and brief["slot"] is None
        wait_lad(cluster, "long", ns, lambda s: s.get("phase") == "Training", "Training")
        delete_job(cluster, "brief-svc", ns)
        # the garbage collector deletes the job's adapters; with their trainer gone, nothing holds them
        wait_for(lambda: get(cluster, "lad", "brief", ns) is None and get(cluster, "lad", "long", ns) is None,
                 timeout=WAIT, what="the job's adapters deleted with it")


def test_an_adapter_that_cannot_join_its_job_fails_with_the_fix(cluster, ns, ray_operator, head, control_port,
                                                               tmp_path):
    data = prompts(tmp_path)
    cases = {  # name -> (spec, words of the message): SPEC rule 9, checked by the operator against the job
        "too-wide": ({"rank": 16}, "rank 16 exceeds the job's lora.rank 8 (the largest rank a slot holds): lower "
                                   "the adapter's rank or raise the job's lora.rank"),
        "odd-groups": ({"nSamplesPerPrompt": 3}, "nSamplesPerPrompt 3 must divide, or be a multiple of, the "
                                                 "trainer's data-parallel size 2"),
        "huge-batch": ({"rolloutBatchSize": 200}, "rolloutBatchSize x nSamplesPerPrompt = 1600 exceeds the job's "
                                                  "cap 1024"),
        # and what only the trainer can check: its 400 carries its message
        "no-data": ({"data": {"path": "/nonexistent/prompts.jsonl"}}, "is not a file the trainer can read"),
    }
    with service(cluster, ns, head, control_port, tmp_path, "strict", parallelism={"data": 2}) as state:
        for name, (spec, _) in cases.items():
            apply(cluster, adapter(name, "strict", data, numSteps=5, **spec), ns)
        for name, (_, words) in cases.items():
            s = wait_lad(cluster, name, ns, lambda s: s.get("phase") == "Failed", "Failed")
            failed = cond(s, "Failed")
            assert (failed["status"], failed["reason"]) == ("True", "ValidationFailed") and words in failed["message"]
            assert ("Warning", "ValidationFailed") in reasons(cluster, name, ns, "ValidationFailed")
            assert FINALIZER not in (lad(cluster, name, ns)["metadata"].get("finalizers") or [])
        assert names(state()) == []
        # what CEL can check on the adapter alone is refused at apply
        res = cluster.kubectl("apply", "-n", ns, "-f", "-", check=False, input=yaml.safe_dump(
            adapter("both-lengths", "strict", data, numSteps=5, numEpochs=1)))
        assert res.returncode != 0 and "numSteps and numEpochs are both set: keep one of them" in res.stderr
        res = cluster.kubectl("apply", "-n", ns, "-f", "-", check=False, input=yaml.safe_dump(
            adapter("too-wide", "strict", data, numSteps=5, rank=4)))
        assert res.returncode != 0 and "the spec of a LoRAAdapter is immutable" in res.stderr
