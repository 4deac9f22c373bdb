"""The trainer takes a whole LoRATrainingJob manifest (`--config`, `--dry-run`): the operator's cluster fields are
left out, and the trainer's list of them is the operator's (a field the operator adds must be named there, or a
manifest would be refused by the trainer)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kora_operator.api.job import LoRATrainingJobSpec, ModelVolumeSpec
from kora_trainer.config import ConfigError, load_config
from kora_trainer.config.load import CLUSTER_FIELDS, CLUSTER_MODEL_FIELDS
from kora_trainer.config.sections import ModelSpec
from kora_trainer.config.trainer import TrainerConfig

SAMPLES = sorted((Path(__file__).resolve().parents[2] / "manifests" / "samples").glob("*.yaml"))


def aliases(model: type) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def test_the_trainers_cluster_fields_are_what_the_operator_adds():
    assert aliases(LoRATrainingJobSpec) - aliases(TrainerConfig) == CLUSTER_FIELDS
    assert aliases(ModelVolumeSpec) - aliases(ModelSpec) == CLUSTER_MODEL_FIELDS


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_every_sample_manifest_plans_in_the_trainer(sample):
    out = subprocess.run([sys.executable, "-m", "kora_trainer.train", "--config", str(sample), "--dry-run",
                          "--nodes", "2x8"], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("world "), out.stderr
    if sample.name == "moe-adapter-mode.yaml":  # tensor 2 x expert 4: planned, and refused at start (not yet)
        assert out.returncode == 2 and "would refuse this job at start" in out.stderr
        assert "tensor 2, expert 4" in out.stderr
    else:
        assert out.returncode == 0, out.stderr


def test_a_bare_trainer_spec_still_refuses_cluster_fields(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("model: {path: /m}\ndata: {path: /d}\nresources: {workers: 2}\n")
    with pytest.raises(ConfigError, match="resources: unknown field"):
        load_config(spec)
