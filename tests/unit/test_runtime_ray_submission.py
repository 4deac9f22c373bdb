"""Runtime Ray, the pure parts: submission ids and ports, the POST body and its entrypoint, the
decision table from a Ray job's state to an action and a status, and the failure message."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from kora_operator.api.job import LoRATrainingJob
from kora_operator.builders.configmap import trainer_config_yaml
from kora_operator.builders.ncclenv import NCCL_ENV, POD_INTERFACE
from kora_operator.runtimes import ray as rt
from kora_operator.runtimes.rayjobs import JobInfo, ray_auth_token
from kora_operator.settings import Settings, parse_port_range
from specs import valid_job

UID = "0b7c1f6e-1111-2222-3333-444455556666"
ADDR = "http://127.0.0.1:8265"


def ray_job(**spec) -> LoRATrainingJob:
    doc = valid_job("toy", runtime={"kind": "Ray", "address": ADDR}, **spec)
    doc["metadata"].update(namespace="team-a", uid=UID)
    return LoRATrainingJob.model_validate(doc)


def info(status: str, **kw) -> JobInfo:
    return JobInfo(submission_id=kw.pop("sub", f"kora-{UID}-0"), status=status, **kw)


def test_submission_ids_are_deterministic_and_count_up():
    first = rt.submission_id(UID)
    assert first == f"kora-{UID}-0" == rt.submission_id(UID, 0)
    assert rt.next_submission_id(first) == f"kora-{UID}-1"
    assert rt.next_submission_id(f"kora-{UID}-9") == f"kora-{UID}-10"


def test_control_ports_are_stable_spread_and_in_range():
    ports = [rt.control_port(rt.submission_id(f"uid-{i}"), (8068, 8167)) for i in range(200)]
    assert all(8068 <= p <= 8167 for p in ports) and len(set(ports)) > 50
    assert rt.control_port("kora-x-0", (8068, 8167)) == rt.control_port("kora-x-0", (8068, 8167))
    assert rt.control_port("anything", (9000, 9000)) == 9000


def test_recorded_port_wins_over_the_computed_one():
    assert rt.recorded_port(info("RUNNING", metadata={rt.PORT_KEY: "12345"}), "s", (8068, 8167)) == 12345
    assert rt.recorded_port(None, "s", (9000, 9000)) == 9000


def test_control_url_uses_the_ray_heads_host():
    assert rt.control_url("http://ray-head.ray.svc:8265", 8070) == "http://ray-head.ray.svc:8070"
    assert rt.control_url("https://[::1]:8265/", 8070) == "http://[::1]:8070"


def test_the_submission_carries_config_token_port_and_metadata():
    job = ray_job()
    body = rt.build_submission(job, sub="kora-x-0", token="tok", port=8100,
                               trainer_command=["python", "-m", "kora_trainer.train"])
    env = body["runtime_env"]["env_vars"]
    assert body["submission_id"] == "kora-x-0"
    assert env["KORA_JOB_YAML"] == trainer_config_yaml(job)
    control = (env["KORA_CONTROL_TOKEN"], env["KORA_CONTROL_PORT"], env["KORA_CONTROL_HOST"])
    assert control == ("tok", "8100", "127.0.0.1")
    assert (env["KORA_JOB_NAME"], env["KORA_JOB_NAMESPACE"]) == ("toy", "team-a")
    assert body["metadata"] == {"kora.dev/job": "team-a/toy", "kora.dev/uid": UID, "kora.dev/control-port": "8100"}
    assert all(isinstance(v, str) for v in [*env.values(), *body["metadata"].values()])  # Ray wants strings
    assert body["entrypoint"].endswith("python -m kora_trainer.train --config /dev/stdin --run-dir .kora/runs/kora-x-0")
    assert "KORA_CONTROL_LINGER_S" not in env
    lingering = rt.build_submission(job, sub="s", token="t", port=1, trainer_command=["x"], linger_s=15)
    assert lingering["runtime_env"]["env_vars"]["KORA_CONTROL_LINGER_S"] == "15"


def test_a_remote_ray_head_gets_a_control_plane_on_every_interface():
    doc = valid_job("toy", runtime={"kind": "Ray", "address": "http://ray-head.ray:8265"})
    doc["metadata"]["uid"] = UID
    body = rt.build_submission(LoRATrainingJob.model_validate(doc), sub="s", token="t", port=1, trainer_command=["x"])
    assert body["runtime_env"]["env_vars"]["KORA_CONTROL_HOST"] == "0.0.0.0"


def test_the_entrypoint_pipes_the_config_into_the_trainer(tmp_path):
    """Run the real entrypoint through sh, as Ray does, with a stand-in command that echoes its input."""
    job = ray_job(lora={"rank": 4, "syncMode": "Adapter"})
    probe = [sys.executable, "-c", "import sys, json; print(json.dumps({'argv': sys.argv[1:], "
             "'config': open(sys.argv[2]).read()}))"]
    body = rt.build_submission(job, sub="kora-x-0", token="t", port=1, trainer_command=probe)
    env = {**os.environ, **body["runtime_env"]["env_vars"]}
    out = subprocess.run(body["entrypoint"], shell=True, env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    got = json.loads(out)
    assert got["argv"] == ["--config", "/dev/stdin", "--run-dir", ".kora/runs/kora-x-0"]
    assert got["config"] == trainer_config_yaml(job)
    assert yaml.safe_load(got["config"])["lora"]["rank"] == 4


def decide(i, *, suspend=False, phase=None, restarts=0, backoff=0):
    return rt.decide(i, sub=f"kora-{UID}-0", address=ADDR, suspend=suspend, phase=phase, restarts=restarts,
                     backoff_limit=backoff)


@pytest.mark.parametrize(("ray", "kw", "action", "phase"), [
    (None, {}, rt.Action.SUBMIT, "Pending"),
    ("PENDING", {}, rt.Action.NONE, "Pending"),
    ("RUNNING", {}, rt.Action.NONE, "Running"),
    ("SUCCEEDED", {}, rt.Action.NONE, "Succeeded"),
    ("SUCCEEDED", {"suspend": True}, rt.Action.NONE, "Succeeded"),  # finished is finished
    ("FAILED", {}, rt.Action.NONE, "Failed"),
    ("FAILED", {"backoff": 2, "restarts": 1}, rt.Action.RETRY, "Pending"),
    ("FAILED", {"backoff": 2, "restarts": 2}, rt.Action.NONE, "Failed"),
    ("STOPPED", {}, rt.Action.NONE, "Failed"),  # stopped by someone else
    ("RUNNING", {"suspend": True}, rt.Action.STOP, "Suspended"),
    ("STOPPED", {"suspend": True}, rt.Action.NONE, "Suspended"),
    (None, {"suspend": True}, rt.Action.NONE, "Suspended"),  # created suspended: nothing to stop
    ("STOPPED", {"phase": "Suspended"}, rt.Action.RESUME, "Pending"),
    ("RUNNING", {"phase": "Suspended"}, rt.Action.STOP, "Suspended"),  # resumed before the stop landed
    (None, {"phase": "Suspended"}, rt.Action.SUBMIT, "Pending"),
])
def test_decide(ray, kw, action, phase):
    d = decide(info(ray) if ray else None, **kw)
    assert (d.action, str(d.obs.phase)) == (action, phase)


def test_decide_conditions_and_times():
    ok = decide(info("SUCCEEDED", end_time="2026-11-30T11:00:00Z"))
    assert ok.obs.terminal_time == "2026-11-30T11:00:00Z"
    assert {(c.type, c.status) for c in ok.obs.conditions} >= {("Complete", "True"), ("Training", "False")}
    stopped = decide(info("STOPPED"))
    assert [c.reason for c in stopped.obs.conditions if c.type == "Failed"] == ["TrainerStopped"]
    retry = decide(info("FAILED", message="boom"), backoff=3, restarts=0)
    (training,) = [c for c in retry.obs.conditions if c.type == "Training"]
    assert training.reason == "Retrying" and training.message.startswith("restart 1 of 3")


RAY_FAILURE = (
    "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n"
    "2026-11-30 14:58:11,921\tINFO job_manager.py:581 -- Runtime env is setting up.\n"
    "Running entrypoint for job kora-x-0: printf ... | python -m kora_trainer.train --config /dev/stdin\n"
    "step 1/10 reward 0.100\n"
    "Traceback (most recent call last):\n"
    '  File "train.py", line 80, in main\n'
    "ValueError: data.path /data/train.parquet has no rows\n"
)


def test_failure_message_keeps_the_trainers_last_lines_without_rays_noise():
    msg = rt.failure_message(info("FAILED", message=RAY_FAILURE, driver_exit_code=1))
    assert msg.startswith("Ray job kora-") and "(exit code 1)" in msg
    assert msg.endswith("ValueError: data.path /data/train.parquet has no rows")
    assert "INFO" not in msg and "Running entrypoint" not in msg


def test_failure_message_of_a_huge_log_fits_and_keeps_the_end():
    logs = "".join(f"line {i} " + "x" * 80 + "\n" for i in range(500)) + "KeyError: 'lora'\n"
    msg = rt.failure_message(info("FAILED", message=f"Job entrypoint command failed with exit code 2, last available "
                                                    f"logs (truncated to 20,000 chars):\n{logs}"))
    assert len(msg.encode()) <= 1000 and msg.endswith("KeyError: 'lora'") and "..." in msg


def test_failure_message_without_logs():
    msg = rt.failure_message(info("FAILED", message="Job supervisor actor died"))
    assert msg == f"Ray job kora-{UID}-0 failed: Job supervisor actor died"


def test_job_info_from_rays_json():
    got = JobInfo.from_json({"submission_id": "s", "status": "FAILED", "message": "m", "start_time": 1796050688946,
                             "end_time": 1796050691583, "driver_exit_code": 3, "metadata": {"a": "b"}, "job_id": None})
    assert (got.status, got.terminal, got.driver_exit_code) == ("FAILED", True, 3)
    assert got.start_time == "2026-11-30T14:58:08Z" and got.end_time == "2026-11-30T14:58:11Z"
    assert JobInfo.from_json({"submission_id": "s", "status": "PENDING", "metadata": None}).start_time is None


def test_ray_auth_token_is_found_as_rays_cli_finds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ray_auth_token({}) is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray/auth_token").write_text("from-home\n")
    assert ray_auth_token({}) == "from-home"
    (tmp_path / "tok").write_text("from-path")
    assert ray_auth_token({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "tok")}) == "from-path"
    assert ray_auth_token({"RAY_AUTH_TOKEN": "from-env", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "tok")}) == "from-env"


def test_settings_from_env_and_port_ranges():
    s = Settings.from_env({"KORA_POLL_INTERVAL": "2.5", "KORA_RAY_CONTROL_PORTS": "9000-9009",
                           "KORA_TRAINER_COMMAND": "/opt/venv/bin/python -m kora_trainer.train"})
    assert s.poll_interval == 2.5 and s.trainer_command[0] == "/opt/venv/bin/python"
    assert s.ray_control_ports == (9000, 9009)
    assert Settings.from_env({}) == Settings(kuberay_progress=False)
    # KubeRay trainers are polled at their head service's cluster DNS name: by default only in a pod
    assert Settings.from_env({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}).kuberay_progress
    assert Settings.from_env({"KORA_KUBERAY_PROGRESS": "1"}).kuberay_progress
    assert Settings(poll_interval=5).linger_s == 15 and Settings(poll_interval=1).linger_s == 10
    assert parse_port_range("8068") == (8068, 8068)
    for bad in ("x", "9000-8000", "0-1", "1-70000"):
        with pytest.raises(ValueError, match="port range"):
            parse_port_range(bad)


def test_the_submission_turns_ray_usage_stats_off_unless_the_job_opts_in():
    env = rt.build_submission(ray_job(), sub="s", token="t", port=1, trainer_command=["x"])["runtime_env"]["env_vars"]
    assert env["RAY_USAGE_STATS_ENABLED"] == "0" and env["RAY_USAGE_STATS_REPORT_URL"] == ""
    doc = valid_job("toy", runtime={"kind": "Ray", "address": ADDR, "rayUsageStats": True})
    doc["metadata"]["uid"] = UID
    opted = LoRATrainingJob.model_validate(doc)
    env = rt.build_submission(opted, sub="s", token="t", port=1, trainer_command=["x"])["runtime_env"]["env_vars"]
    assert env["RAY_USAGE_STATS_ENABLED"] == "1"


def test_the_submission_carries_the_nccl_environment_less_the_pod_interface():
    env = rt.build_submission(ray_job(), sub="s", token="t", port=1, trainer_command=["x"])["runtime_env"]["env_vars"]
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_DEBUG"] == "WARN"
    # eth0 is the pod network's name; an existing cluster's machines name their own interfaces (and a local head
    # must stay on loopback), so the cluster's own settings stay in force
    assert not POD_INTERFACE & set(env)
    assert set(NCCL_ENV) - POD_INTERFACE <= set(env)
    doc = valid_job("toy", runtime={"kind": "Ray", "address": ADDR,
                                    "env": {"NCCL_SOCKET_IFNAME": "ens5", "NCCL_NVLS_ENABLE": "1"}})
    doc["metadata"]["uid"] = UID
    over = LoRATrainingJob.model_validate(doc)
    env = rt.build_submission(over, sub="s", token="t", port=1, trainer_command=["x"])["runtime_env"]["env_vars"]
    assert env["NCCL_SOCKET_IFNAME"] == "ens5" and env["NCCL_NVLS_ENABLE"] == "1"
