"""Runtime Ray: the operator (`kora operator`, a real subprocess) submits jobs to a REAL local Ray
head (hack/localray.py: `ray start --head`, token auth, loopback only) through the Ray Jobs API.

The submitted command is the scripted stand-in trainer (tests/scripted_trainer.py, the operator's
--trainer-command), so these tests pin the operator's side — submission, status mapping, retries,
suspend, delete — without depending on the trainer's speed; the "serve" runs use the trainer's
real control-plane server for progress.
"""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import pytest
import yaml

from kora_operator.tokens import derive_token
from localcluster import free_ports, pid_alive, wait_for
from operatorkit import KORA, TEST_OPERATOR_KEY, Operator, apply, children, events, get, job_status, kora_namespace
from raykit import (
    LOGS,
    REAL_TRAINER,
    all_dead,
    applied,
    attempt,
    delete_job,
    job_processes,
    operator_env,
    pids,
    ray_job_doc,
    ray_operator,
    submissions,
    uid_of,
)
from specs import set_path, valid_job

ROOT = Path(__file__).resolve().parents[2]
WAIT = 60


def wait_phase(cluster, name, ns, phase, timeout=WAIT):
    return wait_for(lambda: (s := job_status(cluster, name, ns)).get("phase") == phase and s, timeout=timeout,
                    interval=0.2, what=f"ltj {name} phase {phase} (now {job_status(cluster, name, ns)})")


def condition(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def reasons(cluster, name, ns, *wanting):
    return [(e["type"], e["reason"]) for e in events(cluster, name, ns, wanting=wanting)]


def test_a_job_is_submitted_once_runs_and_succeeds(cluster, ns, ray_operator, head, control_port, tmp_path):
    home = tmp_path / "model"
    doc = ray_job_doc("ok", home, head.dashboard_url, {"mode": "serve", "steps": 3, "linger": 4},
                      lora={"rank": 8, "syncMode": "Adapter"})
    with applied(cluster, doc, ns) as uid:
        s = wait_phase(cluster, "ok", ns, "Succeeded")
        sub = f"kora-{uid}-0"
        assert s["rayJobName"] == sub and s["dashboardURL"] == head.dashboard_url
        assert s["startTime"] and s["completionTime"] and not s.get("restarts")
        assert condition(s, "Complete")["status"] == "True" and condition(s, "ClusterReady")["status"] == "True"
        # the last poll before the trainer went away saw every step
        assert s["progress"]["step"] == 3 and s["progress"]["totalSteps"] == 3 and s["progress"]["rewardMean"] == 1.0
        assert condition(s, "WeightsSynced")["status"] == "True"
        got = submissions(head, uid)
        assert list(got) == [sub] and got[sub]["status"] == "SUCCEEDED"
        assert got[sub]["metadata"]["kora.dev/control-port"] == str(control_port)
        # what the trainer got: the same job.yaml as the ConfigMap, the job's derived token, the port
        (cm,) = children(cluster, "ok", ns)["ConfigMap"]
        seen = attempt(home, 1)
        assert seen["config"] == cm["data"]["job.yaml"]
        assert seen["env"]["KORA_CONTROL_TOKEN"] == derive_token(TEST_OPERATOR_KEY.encode(), uid)
        assert seen["env"]["KORA_CONTROL_PORT"] == str(control_port) and seen["env"]["KORA_CONTROL_HOST"] == "127.0.0.1"
        assert seen["run_dir"] == f".kora/runs/{sub}"
        got_reasons = reasons(cluster, "ok", ns, "CreatedChildren", "SubmittedRayJob", "TrainerRunning", "Succeeded")
        for r in ("CreatedChildren", "SubmittedRayJob", "TrainerRunning", "Succeeded"):
            assert ("Normal", r) in got_reasons, got_reasons
        row = cluster.kubectl("get", "ltj", "ok", "-n", ns, "--no-headers").stdout.split()
        assert row[:5] == ["ok", "Adapter", "Succeeded", "3", "1"]
        assert not children(cluster, "ok", ns)["RayJob"]
        # finished: nothing left to stop, so kopf drops the finalizer (deleting needs no operator now)
        wait_for(lambda: not get(cluster, "ltj", "ok", ns)["metadata"].get("finalizers"), timeout=WAIT,
                 what="the finalizer of a finished job removed")
        describe = cluster.kubectl("describe", "ltj", "ok", "-n", ns).stdout
        LOGS.mkdir(exist_ok=True)
        (LOGS / "describe-ltj-ray-succeeded.txt").write_text(describe)


def test_a_failed_trainer_fails_the_job_with_its_message(cluster, ns, ray_operator, head, tmp_path):
    doc = ray_job_doc("crash", tmp_path / "m", head.dashboard_url,
                      {"mode": "exit", "code": 3, "say": "ValueError: data.path /data/train.parquet has no rows"})
    with applied(cluster, doc, ns) as uid:
        s = wait_phase(cluster, "crash", ns, "Failed")
        failed = condition(s, "Failed")
        assert (failed["status"], failed["reason"]) == ("True", "TrainerFailed")
        assert "exit code 3" in failed["message"] and "ValueError: data.path" in failed["message"]
        assert "INFO" not in failed["message"]  # Ray's own log lines are left out
        assert ("Warning", "TrainerFailed") in reasons(cluster, "crash", ns, "TrainerFailed")
        assert [j["status"] for j in submissions(head, uid).values()] == ["FAILED"]


def test_backoff_resubmits_and_the_trainer_resumes_from_its_checkpoint(cluster, ns, ray_operator, head, tmp_path):
    home = tmp_path / "m"
    doc = ray_job_doc("retry", home, head.dashboard_url,
                      {"mode": "serve", "steps": 4, "crash_at_step": 2, "step_seconds": 0.3, "linger": 4},
                      checkpoint={"path": str(tmp_path / "ckpt"), "interval": 1}, backoffLimit=1)
    with applied(cluster, doc, ns) as uid:
        s = wait_phase(cluster, "retry", ns, "Succeeded", timeout=90)
        assert s["restarts"] == 1 and s["rayJobName"] == f"kora-{uid}-1"
        got = submissions(head, uid)
        assert {k: v["status"] for k, v in got.items()} == {f"kora-{uid}-0": "FAILED", f"kora-{uid}-1": "SUCCEEDED"}
        # steps 1-2 ran once, then the second attempt went on from the checkpoint at step 2
        assert (home / "steps").read_text().split() == ["1", "2", "3", "4"]
        assert s["progress"]["step"] == 4 and s["progress"]["lastCheckpoint"]["step"] == 4
        assert condition(s, "Checkpointed")["status"] == "True"
        warn = [e for e in events(cluster, "retry", ns, wanting=["TrainerFailed"]) if e["reason"] == "TrainerFailed"]
        assert warn and "restart 1 of 1" in warn[0]["message"] and "scripted crash at step 2" in warn[0]["message"]
        wait_for(lambda: [e["reason"] for e in events(cluster, "retry", ns)].count("SubmittedRayJob") >= 2,
                 timeout=WAIT, what="two SubmittedRayJob events")
        assert [e["reason"] for e in events(cluster, "retry", ns)].count("SubmittedRayJob") == 2


def test_suspend_stops_the_ray_job_and_resume_resubmits(cluster, ns, ray_operator, head, tmp_path):
    home = tmp_path / "m"
    doc = ray_job_doc("pause", home, head.dashboard_url, {"mode": "sleep"})
    with applied(cluster, doc, ns) as uid:
        wait_phase(cluster, "pause", ns, "Running")
        first = wait_for(lambda: pids(home), timeout=WAIT, what="the trainer's pid")
        apply(cluster, set_path(doc, "suspend", True), ns)
        s = wait_phase(cluster, "pause", ns, "Suspended")
        assert condition(s, "Training")["reason"] == "Suspended"
        wait_for(lambda: submissions(head, uid)[f"kora-{uid}-0"]["status"] == "STOPPED", timeout=WAIT,
                 what="the Ray job stopped")
        wait_for(lambda: all_dead(first), timeout=30, what="the trainer process gone")
        assert ("Normal", "StoppedRayJob") in reasons(cluster, "pause", ns, "StoppedRayJob")
        apply(cluster, doc, ns)  # resume
        s = wait_phase(cluster, "pause", ns, "Running")
        assert s["rayJobName"] == f"kora-{uid}-1" and not s.get("restarts")  # a resume is not a restart
        assert submissions(head, uid)[f"kora-{uid}-1"]["status"] == "RUNNING"


def test_deleting_a_running_job_stops_its_ray_job_and_leaves_nothing(cluster, ns, ray_operator, head, tmp_path):
    home = tmp_path / "m"
    apply(cluster, ray_job_doc("doomed", home, head.dashboard_url, {"mode": "sleep"}), ns)
    uid = uid_of(cluster, "doomed", ns)
    wait_phase(cluster, "doomed", ns, "Running")
    trainer = wait_for(lambda: pids(home), timeout=WAIT, what="the trainer's pid")
    assert all(pid_alive(p) for p in trainer) and job_processes(head, "doomed")
    assert get(cluster, "ltj", "doomed", ns)["metadata"]["finalizers"] == ["kora.dev/stop-ray-job"]
    delete_job(cluster, "doomed", ns, timeout=60)  # returns once the finalizer let go
    assert get(cluster, "ltj", "doomed", ns) is None
    assert submissions(head, uid)[f"kora-{uid}-0"]["status"] == "STOPPED"
    wait_for(lambda: all_dead(trainer) and not job_processes(head, "doomed"), timeout=30,
             what=f"no process of the job left (now {job_processes(head, 'doomed')})")
    wait_for(lambda: all(v == [] for v in children(cluster, "doomed", ns).values()), timeout=60, interval=0.5,
             what="the garbage collector to remove the children")


def test_a_restarted_operator_never_submits_twice(cluster, head, control_port, tmp_path):
    with kora_namespace(cluster, "rt-restart") as ns:
        log, env = LOGS / f"operator-{ns}.log", operator_env(head, control_port)
        with Operator(cluster, [ns], log, env=env).running() as op:
            apply(cluster, ray_job_doc("once", tmp_path / "m", head.dashboard_url, {"mode": "sleep"}), ns)
            uid = uid_of(cluster, "once", ns)
            wait_for(lambda: submissions(head, uid), timeout=WAIT, what="the first submission")
            op.kill()  # SIGKILL, maybe before it wrote the status
        with Operator(cluster, [ns], log, env=env).running():
            s = wait_phase(cluster, "once", ns, "Running")
            assert list(submissions(head, uid)) == [f"kora-{uid}-0"] == [s["rayJobName"]]
            # the event follows the submission: a kill between the two loses it (events are best effort), and the
            # restarted operator finds the submission made and posts none, so at most one
            assert [e["reason"] for e in events(cluster, "once", ns)].count("SubmittedRayJob") <= 1
            delete_job(cluster, "once", ns)
            assert submissions(head, uid)[f"kora-{uid}-0"]["status"] == "STOPPED"


def test_an_unreachable_ray_cluster_shows_and_deleting_does_not_hang(cluster, ns, ray_operator, tmp_path):
    (closed,) = free_ports(1)
    apply(cluster, ray_job_doc("nowhere", tmp_path / "m", f"http://127.0.0.1:{closed}", {"mode": "sleep"}), ns)
    s = wait_for(lambda: (s := job_status(cluster, "nowhere", ns)).get("conditions") and
                 any(c["reason"] == "RayUnreachable" for c in s["conditions"]) and s, timeout=WAIT,
                 what="ClusterReady=False RayUnreachable")
    ready = condition(s, "ClusterReady")
    assert ready["status"] == "False" and f"127.0.0.1:{closed}" in ready["message"]
    assert s["phase"] == "Pending" and "rayJobName" not in s
    assert ("Warning", "RayUnreachable") in reasons(cluster, "nowhere", ns, "RayUnreachable")
    delete_job(cluster, "nowhere", ns, timeout=30)  # nothing was submitted: nothing to wait for


def test_a_kuberay_job_gets_no_finalizer(cluster, ns, ray_operator):
    apply(cluster, valid_job("plain"), ns)
    wait_for(lambda: children(cluster, "plain", ns)["RayJob"], timeout=WAIT, what="the RayJob")
    wait_phase(cluster, "plain", ns, "Pending")
    assert not get(cluster, "ltj", "plain", ns)["metadata"].get("finalizers")
    # and its Secret holds the same derived token the operator polls the trainer with
    uid = uid_of(cluster, "plain", ns)
    (secret,) = [s for s in children(cluster, "plain", ns)["Secret"] if "token" in s["data"]]  # beside the engine key
    assert base64.b64decode(secret["data"]["token"]).decode() == derive_token(TEST_OPERATOR_KEY.encode(), uid)


@pytest.mark.slow
def test_the_real_trainer_runs_as_a_ray_job(cluster, head, tmp_path):
    """The real `python -m kora_trainer.train` (the toy task, an untrained toy model, 4 steps) submitted
    by the operator: the config reaches it through /dev/stdin, the token and port through the
    environment, and its progress comes back into the status while it trains."""
    toy = tmp_path / "toy"
    subprocess.run([str(KORA), "make-toy", str(toy), "--target", "0", "--threads", "1"], check=True,
                   capture_output=True, timeout=300)
    spec = yaml.safe_load((ROOT / "trainer/examples/toy.yaml").read_text())
    spec["model"]["path"], spec["data"]["path"] = str(toy), str(toy / "train.parquet")
    spec["algorithm"]["numSteps"] = 4
    spec["runtime"] = {"kind": "Ray", "address": head.dashboard_url}
    spec["resources"] = {"workers": 0, "gpusPerWorker": 0}
    doc = {"apiVersion": "kora.dev/v1alpha1", "kind": "LoRATrainingJob", "metadata": {"name": "toy"}, "spec": spec}
    (port,) = free_ports(1)
    steps_seen: set[int] = set()
    with kora_namespace(cluster, "rt-real") as ns, ray_operator(cluster, ns, head, port, REAL_TRAINER):
        apply(cluster, doc, ns)

        def done():
            s = job_status(cluster, "toy", ns)
            if "step" in s.get("progress", {}):
                steps_seen.add(s["progress"]["step"])
            return s.get("phase") in ("Succeeded", "Failed") and s
        s = wait_for(done, timeout=300, interval=0.3, what=f"the toy job to end (now {job_status(cluster, 'toy', ns)})")
        assert s["phase"] == "Succeeded", s
        assert s["progress"]["totalSteps"] == 4 and max(steps_seen) >= 1, steps_seen
        assert s["progress"]["lastSync"]["mode"] == "Merge" and s["progress"]["lastSync"]["bytes"] > 0
        # an untrained toy earns reward 0, moves no adapter weight, and the trainer skips those pushes:
        # the engines keep version 0, which WeightsSynced reports as behind unless the trainer also
        # publishes `syncedStep` (see progress.py)
        assert "rewardMean" in s["progress"] and condition(s, "WeightsSynced")
        delete_job(cluster, "toy", ns)
