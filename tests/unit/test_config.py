"""The trainer config: YAML + key=value overrides, quantities, and no heavy imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kora_trainer.config import ConfigError, load_config
from kora_trainer.config.quantity import format_bytes, parse_bytes
from specs import valid_job


def write(tmp_path: Path, doc) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_loads_a_whole_manifest_or_a_bare_spec(tmp_path: Path):
    spec = valid_job()["spec"]
    del spec["resources"]
    spec["model"] = {"path": "/m"}
    cfg, _ = load_config(write(tmp_path, spec))
    assert cfg.lora.rank == 8
    assert cfg.sync.buffer_size == 512 * 2**20


def test_overrides_use_the_api_field_names(tmp_path: Path):
    spec = {"model": {"path": "/m"}, "lora": {"rank": 8}, "data": {"path": "/d.jsonl"}}
    cfg, warnings = load_config(write(tmp_path, spec),
                                ["lora.syncMode=Adapter", "algorithm.numSteps=20", "sync.bufferSize=64Mi"])
    assert cfg.lora.sync_mode == "Adapter" and cfg.algorithm.num_steps == 20
    assert cfg.sync.buffer_size == 64 * 2**20 and warnings == []


def test_override_that_breaks_a_rule_is_refused(tmp_path: Path):
    spec = {"model": {"path": "/m"}, "lora": {"rank": 8}, "data": {"path": "/d.jsonl"}}
    with pytest.raises(ConfigError, match=r"rollout.dpSize 1"):
        load_config(write(tmp_path, spec), ["lora.syncMode=Adapter", "rollout.dpSize=2"])
    with pytest.raises(ConfigError, match=r"dotted.key=value"):
        load_config(write(tmp_path, spec), ["lora.syncMode"])
    with pytest.raises(ConfigError, match=r"lora.rank: Input should be greater than or equal to 1"):
        load_config(write(tmp_path, spec), ["lora.rank=0"])


def test_missing_config_file_names_it():
    with pytest.raises(ConfigError, match=r"--config /nonexistent.yaml"):
        load_config("/nonexistent.yaml")


@pytest.mark.parametrize(("text", "n"), [("512Mi", 512 * 2**20), ("1Gi", 2**30), ("1.5Ki", 1536),
                                         (4096, 4096), ("2G", 2 * 10**9), ("100", 100)])
def test_byte_quantities(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["", "12XB", "-1", 0, "abc", True])
def test_bad_quantities(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_quantity_round_trip():
    assert format_bytes(512 * 2**20) == "512Mi" and format_bytes(1000) == 1000


def test_config_imports_no_torch_or_kubernetes():
    code = ("import sys, kora_trainer.config; "
            "bad = {'torch', 'kubernetes', 'kopf', 'ray', 'transformers'} & set(sys.modules); "
            "print(sorted(bad)); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("override", "field"), [
    ("algorithm.rolloutBatchSize=1000000000000", "algorithm.rolloutBatchSize"),
    ("algorithm.nSamplesPerPrompt=100000", "algorithm.nSamplesPerPrompt"),
    ("algorithm.maxNewTokens=1000000000", "algorithm.maxNewTokens"),
    ("algorithm.numSteps=10000000000", "algorithm.numSteps"),
    ("algorithm.seed=-1", "algorithm.seed"),
    ("algorithm.seed=36893488147419103232", "algorithm.seed"),  # 2^65: torch's generators take 64 bits
])
def test_batch_and_length_integers_are_bounded_and_the_field_is_named(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, ["model.path=/m", "data.path=/d.jsonl", override])


def test_an_adapters_integers_are_bounded_like_the_jobs():
    from pydantic import ValidationError

    from kora_trainer.config.sections import AdapterRunConfig

    base = {"rank": 4, "data": {"path": "/d.jsonl"}}
    AdapterRunConfig.model_validate({**base, "rolloutBatchSize": 64, "seed": 7})
    for field, value in (("rolloutBatchSize", 10**12), ("nSamplesPerPrompt", 10**6), ("numSteps", 10**12),
                         ("seed", -3), ("seed", 2**64)):
        with pytest.raises(ValidationError, match=field):
            AdapterRunConfig.model_validate({**base, field: value})
