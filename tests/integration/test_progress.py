"""Progress: the operator polls the trainer's REAL control-plane server (kora_trainer.control_plane,
run here in the test process and driven through its Progress object, as the training loop drives it)
and writes status.progress, the printer columns and the WeightsSynced / Checkpointed conditions.

The job runs on a real local Ray head (runtime Ray, the scripted trainer sleeping), so the operator
finds the control plane as it would a real trainer's: the Ray head's host, the port recorded in the
submission, the token derived from the job's uid.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kora_operator.tokens import derive_token
from kora_trainer.control_plane import ControlPlane, Progress
from kora_trainer.recorder import human_duration
from localcluster import wait_for
from operatorkit import TEST_OPERATOR_KEY, events, job_status
from raykit import applied, ray_job_doc

WAIT = 60


@contextmanager
def trainer(cluster, ns, head, control_port, tmp_path, name, total=10, token=None, **spec) -> Iterator[Progress]:
    """A runtime-Ray job (the Ray job sleeps) and, for it, the trainer's control plane on `control_port`."""
    doc = ray_job_doc(name, tmp_path / name, head.dashboard_url, {"mode": "sleep"}, **spec)
    with applied(cluster, doc, ns) as uid:
        wait_for(lambda: job_status(cluster, name, ns).get("phase") == "Running", timeout=WAIT,
                 what=f"ltj {name} Running")
        progress = Progress(total, "Adapter")
        server = ControlPlane(progress, token or derive_token(TEST_OPERATOR_KEY.encode(), uid), control_port,
                              host="127.0.0.1").start()
        try:
            yield progress
        finally:
            server.stop()


def synced(progress: Progress, version: int, nbytes: int = 4096) -> None:
    progress.record_sync({"mode": "Adapter", "bytes": nbytes, "ms": 12.5, "adapter_version": version,
                          "checksum": f"sha-{version}", "pushed": True})


def wait_progress(cluster, name, ns, pred, what):
    return wait_for(lambda: (s := job_status(cluster, name, ns)) and pred(s) and s, timeout=WAIT, interval=0.2,
                    what=f"{what} (now {job_status(cluster, name, ns).get('progress')})")


def cond(status, type_):
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def test_progress_moves_step_and_reward_in_status_and_kubectl_get(cluster, ns, ray_operator, head, control_port,
                                                                  tmp_path):
    with trainer(cluster, ns, head, control_port, tmp_path, "climb", total=10) as progress:
        progress.update(phase="Running")
        for step, reward in ((1, 0.125), (4, 0.5)):
            synced(progress, step)
            left = (10 - step) * 1.5  # what the recorder's StepRate would say at 1.5 s per step
            progress.update(step=step, rewardMean=reward, secondsPerStep=1.5, estimatedRemainingSeconds=round(left),
                            eta=human_duration(left))
            s = wait_progress(cluster, "climb", ns, lambda s, n=step: s.get("progress", {}).get("step") == n,
                              f"progress.step {step}")
            row = cluster.kubectl("get", "ltj", "climb", "-n", ns, "--no-headers").stdout.split()
            assert row[2:5] == ["Running", str(step), str(reward)], row
        p = s["progress"]
        assert p["totalSteps"] == 10 and p["rewardMean"] == 0.5
        assert {k: p["lastSync"][k] for k in ("mode", "bytes", "milliseconds", "adapterVersion", "checksum")} == {
            "mode": "Adapter", "bytes": 4096, "milliseconds": 12.5, "adapterVersion": 4, "checksum": "sha-4"}
        assert p["lastSync"]["time"].endswith("Z")
        wide = cluster.kubectl("get", "ltj", "climb", "-n", ns, "-o", "wide").stdout
        assert "TOTAL" in wide.splitlines()[0] and " 10 " in wide.splitlines()[1]
        # the ETA the trainer measured, copied into status.progress and shown by -o wide
        assert p["secondsPerStep"] == 1.5 and p["estimatedRemainingSeconds"] == 9 and p["eta"] == "9s"
        assert wide.splitlines()[0].split()[-1] == "ETA" and wide.splitlines()[1].split()[-1] == "9s"
        synced_cond = cond(s, "WeightsSynced")
        assert synced_cond["status"] == "True" and "version 4" in synced_cond["message"]


def test_a_stale_policy_turns_weights_synced_false_and_back(cluster, ns, ray_operator, head, control_port, tmp_path):
    with trainer(cluster, ns, head, control_port, tmp_path, "stale", total=20,
                 deployment={"async": True, "maxStaleness": 2}) as progress:
        synced(progress, 5)
        progress.update(step=5, rewardMean=0.3)
        s = wait_progress(cluster, "stale", ns, lambda s: (cond(s, "WeightsSynced") or {}).get("status") == "True",
                          "WeightsSynced True")
        progress.update(step=7)  # 2 behind: still within maxStaleness 2
        wait_progress(cluster, "stale", ns, lambda s: s["progress"]["step"] == 7, "step 7")
        assert cond(job_status(cluster, "stale", ns), "WeightsSynced")["status"] == "True"
        progress.update(step=8)  # 3 behind: stale
        s = wait_progress(cluster, "stale", ns, lambda s: cond(s, "WeightsSynced")["status"] == "False",
                          "WeightsSynced False")
        c = cond(s, "WeightsSynced")
        assert c["reason"] == "EnginesBehind" and "version 5" in c["message"] and "3 steps behind" in c["message"]
        got = events(cluster, "stale", ns, wanting=["EnginesBehind"])
        assert ("Warning", "EnginesBehind") in [(e["type"], e["reason"]) for e in got]
        synced(progress, 8)  # the engines caught up
        s = wait_progress(cluster, "stale", ns, lambda s: cond(s, "WeightsSynced")["status"] == "True",
                          "WeightsSynced True again")
        assert s["progress"]["lastSync"]["adapterVersion"] == 8


def test_checkpointed_follows_the_last_checkpoint(cluster, ns, ray_operator, head, control_port, tmp_path):
    with trainer(cluster, ns, head, control_port, tmp_path, "saver", checkpoint={"path": "/ckpt/saver", "interval": 5}
                 ) as progress:
        synced(progress, 3)
        progress.update(step=3)
        s = wait_progress(cluster, "saver", ns, lambda s: cond(s, "Checkpointed") is not None, "Checkpointed")
        c = cond(s, "Checkpointed")
        assert (c["status"], c["reason"]) == ("False", "NoCheckpointYet") and "/ckpt/saver" in c["message"]
        progress.update(step=5, lastCheckpoint={"path": "/ckpt/saver/step_5", "step": 5})
        s = wait_progress(cluster, "saver", ns, lambda s: cond(s, "Checkpointed")["status"] == "True",
                          "Checkpointed True")
        assert s["progress"]["lastCheckpoint"] == {"path": "/ckpt/saver/step_5", "step": 5}
        assert "step 5" in cond(s, "Checkpointed")["message"]
        got = events(cluster, "saver", ns, wanting=["Checkpointed"])
        assert ("Normal", "Checkpointed") in [(e["type"], e["reason"]) for e in got]


def test_a_trainer_with_another_token_is_not_believed(cluster, ns, ray_operator, head, control_port, tmp_path):
    with trainer(cluster, ns, head, control_port, tmp_path, "impostor", token="not-the-derived-token") as progress:
        progress.update(step=9, rewardMean=1.0)
        wait_for(lambda: ("Warning", "ProgressUnavailable") in
                 [(e["type"], e["reason"]) for e in events(cluster, "impostor", ns)],
                 timeout=WAIT, what="a ProgressUnavailable warning")
        s = job_status(cluster, "impostor", ns)
        assert "progress" not in s and s["phase"] == "Running"
