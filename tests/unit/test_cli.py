"""`kora validate` and `kora render`, run as the installed console script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kora_trainer.config import load_config
from specs import valid_job, violating_job

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "manifests/samples").glob("*.yaml"))


def kora(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("kora")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, input=input, timeout=60)


def write(tmp_path: Path, *docs) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_samples_are_valid(sample: Path):
    result = kora("validate", str(sample))
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout


def test_samples_cover_the_recipes():
    names = {p.stem for p in SAMPLES}
    assert {"merge-mode", "adapter-mode", "moe-adapter-mode", "vl-merge-mode"} <= names


def test_validate_reports_each_problem_and_exits_1(tmp_path: Path):
    path = write(tmp_path, violating_job("adapter-dp-size", "a"), violating_job("router-needs-adapter", "b"))
    result = kora("validate", path)
    assert result.returncode == 1
    assert "LoRATrainingJob/a: error: lora.syncMode Adapter requires rollout.dpSize 1" in result.stderr
    assert "LoRATrainingJob/b: error: lora.targetModules contains router" in result.stderr


def test_validate_checks_the_adapters_a_job_lists(tmp_path: Path):
    adapters = [{"name": "a", "rank": 64, "data": {"path": "/d.parquet"}},
                {"name": "a", "rank": 4, "data": {"path": "/d.parquet"}}]
    doc = valid_job(lora={"rank": 8, "syncMode": "Adapter"}, multiLora={"maxAdapters": 1, "adapters": adapters})
    result = kora("validate", write(tmp_path, doc))
    assert result.returncode == 1
    assert "error: multiLora.adapters lists 2 adapters and multiLora.maxAdapters is 1" in result.stderr
    assert "error: multiLora.adapters names a 2 times" in result.stderr
    assert "error: multiLora.adapters[0] (a): rank 64 exceeds the job's lora.rank 8" in result.stderr


def test_validate_warns_without_failing_when_no_mode(tmp_path: Path):
    doc = valid_job()
    del doc["spec"]["lora"]["syncMode"]
    result = kora("validate", write(tmp_path, doc))
    assert result.returncode == 0
    assert "warning: lora.syncMode is not set: using Merge" in result.stdout


def test_validate_unreadable_file():
    result = kora("validate", "/nonexistent/job.yaml")
    assert result.returncode == 1 and "cannot read" in result.stderr


def test_render_prints_a_config_map_the_trainer_loads(tmp_path: Path):
    result = kora("render", "-n", "team-a", write(tmp_path, valid_job("demo")))
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Secret", "Secret", "NetworkPolicy", "RayJob"]
    cm = docs[0]
    assert cm["metadata"]["namespace"] == "team-a"
    assert cm["metadata"]["name"] == "demo-trainer-config"
    assert cm["metadata"]["labels"]["kora.dev/job-name"] == "demo"
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(cm["data"]["job.yaml"])
    cfg, _warnings = load_config(rendered)
    assert cfg.lora.rank == 8 and cfg.model.path == "/nonexistent/models/tiny"
    assert "resources" not in cm["data"]["job.yaml"]  # the trainer gets only its own sections


def test_render_refuses_an_invalid_job(tmp_path: Path):
    result = kora("render", write(tmp_path, violating_job("custom-reward-path")))
    assert result.returncode == 1 and "data.customRewardPath" in result.stderr


def test_render_shows_a_placeholder_token_unless_asked(tmp_path: Path):
    path = write(tmp_path, valid_job("demo"))
    secret, key = list(yaml.safe_load_all(kora("render", path).stdout))[1:3]
    assert secret["stringData"]["token"] == "<generated-by-the-operator-at-create-time>"
    assert key["stringData"]["key"] == "<random-made-by-the-operator-at-create-time>"
    secret, key = list(yaml.safe_load_all(kora("render", "--generate-token", path).stdout))[1:3]
    assert len(secret["stringData"]["token"]) >= 43 and len(key["stringData"]["key"]) >= 43


def test_the_trainer_refuses_a_missing_model_path_and_names_the_fix(tmp_path):
    """No magic: a missing model.path is an error (exit 2) that says how to make the toy, not a silent build."""
    import subprocess
    import sys
    from pathlib import Path

    toy_yaml = Path(__file__).resolve().parents[2] / "trainer" / "examples" / "toy.yaml"
    missing = tmp_path / "toy"
    proc = subprocess.run([sys.executable, "-m", "kora_trainer.train", "--config", str(toy_yaml),
                           f"model.path={missing}", f"data.path={missing}/train.parquet", "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"model.path {missing} does not exist" in proc.stderr and "--make-toy" in proc.stderr
    assert not missing.exists()


def test_the_trainer_refuses_a_missing_data_path_and_names_the_fix(tmp_path):
    """A missing data.path is refused before Ray starts (exit 2, naming the field and the fix), not a rollout
    manager that dies at its creation with Ray's traceback (found on the GPU: multi-LoRA reported it per adapter)."""
    import subprocess
    import sys
    from pathlib import Path

    from kora_trainer.toys.lm import make_toy

    toy_yaml = Path(__file__).resolve().parents[2] / "trainer" / "examples" / "toy.yaml"
    make_toy(tmp_path / "toy", dataset="train.jsonl")
    missing = tmp_path / "toy" / "train.parquet"
    proc = subprocess.run([sys.executable, "-m", "kora_trainer.train", "--config", str(toy_yaml),
                           f"model.path={tmp_path / 'toy'}", f"data.path={missing}", "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"data.path {missing} does not exist" in proc.stderr and "--make-toy" in proc.stderr, proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr
