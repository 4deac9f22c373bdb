"""`make demo` as a test: kubectl apply -> the operator -> the REAL trainer -> kubectl describe.

Every part is real: etcd + kube-apiserver + kube-controller-manager on 127.0.0.1 (hack/localcluster.py),
a local Ray head (hack/localray.py), `kora operator` as a process of its own, and the trainer it
submits through the Ray Jobs API — `python -m kora_trainer.train` with its Ray actors and its reference
engine process. The job is manifests/samples/toy-local.yaml (what `make demo` applies) shrunk to a
few small steps on a toy model made in a temp dir (untrained: the pipeline is under test here, so the
custom reward tests/e2e/toy_rewards.py gives it a signal from the first step).

What the trainer must offer, and nothing more, is its documented interface: the control plane's
GET /status (`resumedFromStep`, `lastCheckpoint`, lingering up to KORA_CONTROL_LINGER_S until the
operator read the final phase), LoRA-only checkpoints under checkpoint.path that a rerun resumes from
(printing `resumed from checkpoint step K`), the PEFT export in <checkpoint.path>/lora_adapter/, and
its `step i/N` progress lines.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from kora_operator.tokens import derive_token
from localcluster import free_ports, pid_alive, wait_for
from localray import LocalRay
from operatorkit import (
    TEST_OPERATOR_KEY,
    Watch,
    apply,
    children,
    events,
    get,
    job_status,
    kora_namespace,
    local_cluster,
)
from raykit import (
    LOGS,
    REAL_TRAINER,
    all_dead,
    cmdline,
    delete_job,
    job_processes,
    ray_head,
    ray_job_logs,
    ray_operator,
    submissions,
    trainer_drivers,
    trainer_status,
    uid_of,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "toy-local.yaml"
HERE = Path(__file__).resolve().parent
RUN_S = 360  # one job, start to end, on the 2-core machine with other work on it (measured: ~40-60 s)
FINAL = ("Succeeded", "Failed")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("kora-cluster")) as c:
        yield c



@pytest.fixture(scope="module")
def head(tmp_path_factory):
    # the Ray workers (the rollout worker scores with toy_rewards) inherit the head's environment
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    with ray_head(tmp_path_factory.mktemp("ray-cwd"), num_cpus=2, env={"PYTHONPATH": pythonpath}) as h:
        yield h


@pytest.fixture(scope="module")
def control_port():
    return free_ports(1)[0]


@pytest.fixture(scope="module")
def ns(cluster):
    with kora_namespace(cluster, "e2e") as name:
        yield name


@pytest.fixture(scope="module")
def operator(cluster, ns, head, control_port):
    with ray_operator(cluster, ns, head, control_port, REAL_TRAINER) as op:
        yield op


def toy_job(name: str, head: LocalRay, toy: Path, ckpt: Path, steps: int, interval: int,
            backoff_limit: int = 0) -> dict[str, Any]:
    """manifests/samples/toy-local.yaml, pointed at this Ray head and toy, with tiny steps."""
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["runtime"]["address"] = head.dashboard_url
    spec["model"]["path"] = str(toy)
    spec["data"].update(path=str(toy / "train.parquet"), rewardType="custom",
                        customRewardPath="toy_rewards.odd_first_digit")
    spec["algorithm"].update(numSteps=steps, rolloutBatchSize=8, nSamplesPerPrompt=4, globalBatchSize=16,
                             innerEpochs=1)
    spec["sync"]["bufferSize"] = "256Ki"
    spec["checkpoint"].update(path=str(ckpt), interval=interval, loraOnly=True, exportHF=True)
    spec["backoffLimit"] = backoff_limit
    return doc


def wait_final(cluster, name: str, ns: str, timeout: float = RUN_S) -> dict[str, Any]:
    return wait_for(lambda: (s := job_status(cluster, name, ns)).get("phase") in FINAL and s, timeout=timeout,
                    interval=1, what=f"ltj {name} to finish (now {job_status(cluster, name, ns)})")


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


def step_lines(logs: str) -> list[int]:
    """The steps a trainer ran, from its `step i/N ...` progress lines."""
    return [int(m.group(1)) for m in re.finditer(r"^step (\d+)/\d+ ", logs, re.MULTILINE)]


def test_apply_trains_to_the_end_and_describe_shows_it(cluster, ns, operator, head, toy_dir, tmp_path):
    """Pending -> Running -> Succeeded, progress up to the last step, reward, events, the PEFT export,
    and `kubectl describe` showing it."""
    steps, ckpt = 4, tmp_path / "ckpt"
    doc = toy_job("toy-local", head, toy_dir, ckpt, steps=steps, interval=2)
    with Watch(cluster, "toy-local", ns) as watch:
        apply(cluster, doc, ns)
        uid = uid_of(cluster, "toy-local", ns)
        s = wait_final(cluster, "toy-local", ns)
        sub = f"kora-{uid}-0"
        logs = ray_job_logs(head, sub)
        assert s["phase"] == "Succeeded", (s, logs[-3000:])
        wait_for(lambda: watch.phases()[-1:] == ["Succeeded"], timeout=10, what="the watch to see Succeeded")
    describe = cluster.kubectl("describe", "ltj", "toy-local", "-n", ns).stdout
    LOGS.mkdir(exist_ok=True)
    (LOGS / "describe-ltj-e2e.txt").write_text(describe)
    (LOGS / "watch-ltj-e2e.txt").write_text("\n".join(" ".join(map(str, row)) for row in watch.rows))
    # the phases as the API server stored them (runtime Ray: Pending while the submission waits to start,
    # there is no cluster to provision; KubeRay jobs show Provisioning while their RayCluster is created)
    assert watch.phases() == ["Pending", "Running", "Succeeded"], watch.rows
    # progress: climbed while it ran, and the operator read the final step (the trainer lingered for it)
    seen = watch.steps()
    assert seen == sorted(seen) and len(set(seen)) >= 2, seen
    p = s["progress"]
    assert p["step"] == p["totalSteps"] == steps, p
    assert isinstance(p["rewardMean"], float) and 0.0 <= p["rewardMean"] <= 1.0
    assert p["lastSync"]["mode"] == "Merge" and p["lastSync"]["bytes"] > 0
    assert p["lastCheckpoint"]["step"] == steps and p["lastCheckpoint"]["path"].startswith(str(ckpt)), p
    assert condition(s, "Checkpointed")["status"] == "True" and condition(s, "Complete")["status"] == "True"
    assert not s.get("restarts") and s["rayJobName"] == sub
    assert step_lines(logs) == list(range(1, steps + 1)), logs[-3000:]
    # events for the job, and the HF-PEFT export of the final adapter
    got = [(e["type"], e["reason"]) for e in events(cluster, "toy-local", ns, wanting=[
        "CreatedChildren", "SubmittedRayJob", "TrainerRunning", "Succeeded"])]
    for reason in ("CreatedChildren", "SubmittedRayJob", "TrainerRunning", "Succeeded"):
        assert ("Normal", reason) in got, got
    assert (ckpt / "lora_adapter" / "adapter_config.json").is_file(), sorted(f.name for f in ckpt.iterdir())
    for pattern in (r"\n  Phase:\s+Succeeded\n", rf"\n    Step:\s+{steps}\n", r"\n    Reward Mean:\s+[\d.]+\n",
                    r"\n  Restarts:\s+0\n", r"Normal\s+TrainerRunning\s"):
        assert re.search(pattern, describe), (pattern, describe)
    delete_job(cluster, "toy-local", ns)


def test_a_data_parallel_job_reaches_succeeded(cluster, ns, operator, head, toy_dir, tmp_path):
    """parallelism.data 2 through the operator: two trainer ranks (Ray actors) on the job's Ray cluster, to the
    last step, Succeeded."""
    steps, ckpt = 3, tmp_path / "ckpt"
    doc = toy_job("toy-dp2", head, toy_dir, ckpt, steps=steps, interval=steps)
    doc["spec"]["parallelism"] = {"data": 2}
    apply(cluster, doc, ns)
    uid = uid_of(cluster, "toy-dp2", ns)
    s = wait_final(cluster, "toy-dp2", ns)
    logs = ray_job_logs(head, f"kora-{uid}-0")
    assert s["phase"] == "Succeeded", (s, logs[-3000:])
    assert s["progress"]["step"] == steps and step_lines(logs) == list(range(1, steps + 1)), logs[-3000:]
    assert "x 2 rank(s)" in logs and "rank 1 on 127.0.0.1" in logs, logs[-3000:]
    delete_job(cluster, "toy-dp2", ns)


@pytest.mark.parametrize("data", [1, 2])
def test_a_diffusion_job_reaches_succeeded_with_its_progress(cluster, ns, operator, head, diffusion_toy_dir, tmp_path,
                                                             data):
    """manifests/samples/diffusion-toy-local.yaml (issue 23) through the operator: Flow-GRPO on the diffusion toy's
    LoRA, its engine folding the pushed A/B pairs, to the last step; status shows the progress and the sync. At
    data 2 the job's two FSDP2 ranks run as Ray actors in the head's cluster, each taking its half of every
    optimizer step's prompt groups."""
    steps, ckpt = 3, tmp_path / "ckpt"
    doc = yaml.safe_load((ROOT / "manifests" / "samples" / "diffusion-toy-local.yaml").read_text())
    doc["metadata"]["name"] = name = f"diffusion-toy-dp{data}"
    spec = doc["spec"]
    spec["runtime"]["address"] = head.dashboard_url
    spec["model"]["path"] = str(diffusion_toy_dir)
    spec["data"]["path"] = str(diffusion_toy_dir / "prompts.jsonl")
    spec["algorithm"].update(numSteps=steps, rolloutBatchSize=4, nSamplesPerPrompt=4)
    spec["diffusion"]["numInferenceSteps"] = 4
    spec["checkpoint"].update(path=str(ckpt), interval=steps)
    if data > 1:
        spec["parallelism"] = {"data": data}
    apply(cluster, doc, ns)
    uid = uid_of(cluster, name, ns)
    s = wait_final(cluster, name, ns)
    assert s.get("rayJobName"), s  # submitted: the operator took the job as valid
    logs = ray_job_logs(head, f"kora-{uid}-0")
    assert s["phase"] == "Succeeded", (s, logs[-3000:])
    p = s["progress"]
    assert p["step"] == p["totalSteps"] == steps and isinstance(p["rewardMean"], float), p
    assert p["lastSync"]["mode"] == "EngineMerge" and p["lastSync"]["bytes"] > 0, p
    assert p["lastCheckpoint"]["step"] == steps, p
    assert step_lines(logs) == list(range(1, steps + 1)), logs[-3000:]
    assert "LoRA IPC weight sync v1 [transformer]: pushed 30 lora tensors" in logs, logs[-3000:]
    assert f"x {data} rank(s)" in logs, logs[-3000:]
    if data > 1:
        assert "rank 1 on 127.0.0.1" in logs, logs[-3000:]
    delete_job(cluster, name, ns)


def test_a_killed_trainer_restarts_once_and_resumes_from_its_checkpoint(cluster, ns, operator, head, toy_dir,
                                                                         control_port, tmp_path):
    """SIGKILL the trainer after its first checkpoint: backoffLimit 1 resubmits it, the rerun resumes at
    the checkpoint's step K (no step up to K runs twice), and the job succeeds with restarts 1."""
    steps, interval, ckpt = 10, 2, tmp_path / "ckpt"
    doc = toy_job("phoenix", head, toy_dir, ckpt, steps=steps, interval=interval, backoff_limit=1)
    with Watch(cluster, "phoenix", ns) as watch:
        apply(cluster, doc, ns)
        uid = uid_of(cluster, "phoenix", ns)
        token = derive_token(TEST_OPERATOR_KEY.encode(), uid)
        # the first checkpoint, as the trainer reports it (never its final phase: that read is the operator's)
        first = wait_for(lambda: (t := trainer_status(control_port, token)) and (t.get("lastCheckpoint") or {})
                         .get("step") and t, timeout=RUN_S, interval=0.3, what="the trainer's first checkpoint")
        saved = int(first["lastCheckpoint"]["step"])
        assert first["phase"] == "Running" and saved < steps and first["resumedFromStep"] is None, first
        (driver,) = trainer_drivers(head, "phoenix")
        os.kill(driver, signal.SIGKILL)
        wait_for(lambda: not pid_alive(driver), timeout=30, what="the killed trainer gone")
        # the rerun: the control plane says where it resumed (read while it runs, before its final phase)
        resumed = wait_for(lambda: (t := trainer_status(control_port, token)) and t.get("resumedFromStep") is not None
                           and t, timeout=RUN_S, interval=0.3, what="the resubmitted trainer's resumedFromStep")
        k = int(resumed["resumedFromStep"])
        s = wait_final(cluster, "phoenix", ns)
    second = f"kora-{uid}-1"
    logs = ray_job_logs(head, second)
    assert s["phase"] == "Succeeded", (s, logs[-3000:])
    assert s["restarts"] == 1 and s["rayJobName"] == second
    assert {k_: v["status"] for k_, v in submissions(head, uid).items()} == {
        f"kora-{uid}-0": "FAILED", second: "SUCCEEDED"}
    # it resumed from the last checkpoint the first attempt wrote (a multiple of the interval, >= the one seen)
    assert saved <= k < steps and k % interval == 0, (saved, k)
    assert f"resumed from checkpoint step {k}" in logs, logs[-3000:]
    first_logs = ray_job_logs(head, f"kora-{uid}-0")
    assert max(step_lines(first_logs)) >= k, first_logs[-3000:]
    # steps up to K are not redone: the rerun's first step is K+1
    assert step_lines(logs) == list(range(k + 1, steps + 1)), logs[-3000:]
    # and the Step column never went back below K once it got there (the operator's last read of the
    # killed attempt may be older than K), nor back at all during the rerun
    (LOGS / "watch-ltj-e2e-restart.txt").write_text("\n".join(" ".join(map(str, row)) for row in watch.rows))
    seen, rerun = watch.steps(), watch.steps(restarts=1)
    got_there = next(i for i, step in enumerate(seen) if step >= k)
    assert all(step >= k for step in seen[got_there:]), watch.rows
    assert rerun == sorted(rerun) and rerun[-1] == steps, watch.rows
    assert s["progress"]["lastCheckpoint"]["step"] == steps
    warn = [e for e in events(cluster, "phoenix", ns, wanting=["TrainerFailed"]) if e["reason"] == "TrainerFailed"]
    assert warn and "restart 1 of 1" in warn[0]["message"], warn
    assert (ckpt / "lora_adapter" / "adapter_config.json").is_file()
    delete_job(cluster, "phoenix", ns)


def test_deleting_a_running_job_stops_the_trainer_and_leaves_nothing(cluster, ns, operator, head, toy_dir,
                                                                     tmp_path):
    """Delete while it trains: the Ray job is stopped, the driver, its Ray actors and the engine process
    are gone, and the garbage collector removes the ConfigMap and Secret."""
    doc = toy_job("doomed", head, toy_dir, tmp_path / "ckpt", steps=500, interval=100)
    apply(cluster, doc, ns)
    uid = uid_of(cluster, "doomed", ns)
    wait_for(lambda: (job_status(cluster, "doomed", ns).get("progress") or {}).get("step", 0) >= 1, timeout=RUN_S,
             interval=1, what=f"ltj doomed training (now {job_status(cluster, 'doomed', ns)})")
    procs = job_processes(head, "doomed")
    lines = {p: " ".join(cmdline(p)) for p in procs}
    assert trainer_drivers(head, "doomed"), lines
    assert any("kora_engine.lm" in c for c in lines.values()), lines  # the engine
    assert any(c.startswith("ray::") for c in lines.values()), lines  # the trainer's Ray actors
    assert {c["kind"] for c in (children(cluster, "doomed", ns)["ConfigMap"] + children(cluster, "doomed", ns)
                                ["Secret"])} == {"ConfigMap", "Secret"}
    delete_job(cluster, "doomed", ns, timeout=90)  # returns once the finalizer let go: the Ray job has ended
    assert get(cluster, "ltj", "doomed", ns) is None
    assert submissions(head, uid)[f"kora-{uid}-0"]["status"] == "STOPPED"
    wait_for(lambda: all_dead(procs) and not job_processes(head, "doomed"), timeout=60,
             what=f"no process of the job left (now {[lines.get(p, p) for p in job_processes(head, 'doomed')]})")
    wait_for(lambda: all(v == [] for v in children(cluster, "doomed", ns).values()), timeout=60, interval=0.5,
             what="the garbage collector to remove the ConfigMap and Secret")


def test_lora_adapters_train_in_a_service_job_and_go_with_it(cluster, ns, operator, head, toy_dir, tmp_path):
    """Multi-LoRA through the operator and the REAL trainer: a service job (no adapters of its own), two
    LoRAAdapters applied -> registered -> their step and reward in `kubectl get lad`; one runs to its numSteps
    (Succeeded, its export written), the other is deleted mid-run (deregistered: Retired on the trainer, then
    forgotten); an adapter rule 9 keeps out fails with the fix; deleting the job deletes its adapters."""
    ckpt = tmp_path / "ckpt"
    doc = toy_job("toy-multi", head, toy_dir, ckpt, steps=1, interval=100)
    spec = doc["spec"]
    spec["algorithm"].pop("numSteps")
    spec["lora"]["syncMode"] = "Adapter"
    spec["multiLora"] = {"maxAdapters": 2, "maxCoalesceWaitSeconds": 0.5}
    spec["checkpoint"]["exportHF"] = False
    apply(cluster, doc, ns)
    wait_for(lambda: job_status(cluster, "toy-multi", ns).get("phase") == "Running", timeout=RUN_S, interval=1,
             what=f"ltj toy-multi Running (now {job_status(cluster, 'toy-multi', ns)})")

    def lad(name: str, **s: Any) -> dict[str, Any]:
        return {"apiVersion": "kora.dev/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": name},
                "spec": {"jobName": "toy-multi", "rank": 8, "data": {"path": str(toy_dir / "train.parquet"),
                         "rewardType": "custom", "customRewardPath": "toy_rewards.odd_first_digit"}, **s}}

    def status(name: str) -> dict[str, Any]:
        return (get(cluster, "lad", name, ns) or {}).get("status") or {}

    apply(cluster, lad("short", numSteps=3), ns)
    apply(cluster, lad("long", numSteps=100000, seed=5), ns)
    apply(cluster, lad("too-big", rank=32), ns)  # the job's lora.rank is 16: rule 9, not CEL-decidable
    wait_for(lambda: status("short").get("phase") == "Succeeded", timeout=RUN_S, interval=1,
             what=f"lad short Succeeded (now {status('short')})")
    wait_for(lambda: status("long").get("phase") == "Training" and (status("long").get("step") or 0) >= 2,
             timeout=RUN_S, interval=1, what=f"lad long training (now {status('long')})")
    table = cluster.kubectl("get", "lad", "-n", ns).stdout
    LOGS.mkdir(exist_ok=True)
    (LOGS / "get-lad-e2e.txt").write_text(table)
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert rows["short"][1:4] == ["toy-multi", "Succeeded", "3"], table  # Job, Phase, Step (printer columns)
    assert rows["long"][1:3] == ["toy-multi", "Training"] and int(rows["long"][3]) >= 2, table
    assert float(rows["long"][4]) >= 0.0, table  # Reward
    short = status("short")
    assert short["exportPath"] and (Path(short["exportPath"]) / "adapter_model.safetensors").is_file(), short
    bad = status("too-big")
    assert bad.get("phase") == "Failed" and "exceeds the job's lora.rank 16" in json.dumps(bad), bad
    assert (job_status(cluster, "toy-multi", ns).get("progress") or {}).get("activeAdapters") == 1
    cluster.kubectl("delete", "lad", "long", "-n", ns, "--wait=true", "--timeout=120s")
    assert (ckpt / "adapters" / "long" / "lora_adapter" / "adapter_model.safetensors").is_file()  # retired: exported
    assert get(cluster, "lad", "long", ns) is None
    delete_job(cluster, "toy-multi", ns)
    wait_for(lambda: get(cluster, "lad", "short", ns) is None and get(cluster, "lad", "too-big", ns) is None,
             timeout=60, interval=0.5, what="the garbage collector to delete the job's adapters")
