"""The engine command lines built from a TrainerConfig (SGLang itself cannot run here, so the
SGLang command is checked as argv; the hf command is parsed by the hf engine's own parser)."""

from __future__ import annotations

import sys

import pytest
import yaml

from kora_engine.lm import server as engine_server
from kora_trainer.config import TrainerConfig
from kora_trainer.orchestration.sglang_launcher import (
    SGLANG_REQUIREMENT,
    UnsupportedEngineConfig,
    engine_command,
    hf_engine_command,
    sglang_command,
    sglang_target_modules,
    sglang_version_problem,
)


def config(**sections) -> TrainerConfig:
    spec = {"model": {"path": "/models/qwen"}, "lora": {"rank": 16}, "data": {"path": "/data/train.parquet"},
            "rollout": {"engine": "sglang", "gpusPerEngine": 2, "dpSize": 1}}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return TrainerConfig.model_validate(spec)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_merge_mode_colocated_serves_a_plain_model_with_a_memory_share():
    launch = sglang_command(config(lora={"syncMode": "Merge"}), port=30001, api_key="k", admin_api_key="adm")
    argv = launch.argv
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"] and launch.url == "http://127.0.0.1:30001"
    assert flag(argv, "--model-path") == "/models/qwen" and flag(argv, "--port") == "30001"
    assert flag(argv, "--tp-size") == "2" and flag(argv, "--dp-size") == "1"
    assert flag(argv, "--mem-fraction-static") == "0.5" and "--enable-memory-saver" in argv
    assert "--enable-lora" not in argv and "--disable-radix-cache" not in argv
    assert "--api-key" not in argv and "--admin-api-key" not in argv  # the keys go by file: see below


def test_adapter_mode_enables_lora_with_sglang_module_names():
    cfg = config(lora={"syncMode": "Adapter", "targetModules": ["linear_qkv", "linear_proj", "linear_fc1", "in_proj"]},
                 deployment={"mode": "Disaggregated"})
    argv = sglang_command(cfg, port=30000, host="0.0.0.0", base_gpu_id=2, random_seed=7).argv
    assert "--enable-lora" in argv and "--disable-radix-cache" in argv
    assert flag(argv, "--max-lora-rank") == "16" and flag(argv, "--max-loras-per-batch") == "2"
    start = argv.index("--lora-target-modules") + 1
    assert argv[start:start + 7] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "in_proj_qkvz"]
    assert "--mem-fraction-static" not in argv and flag(argv, "--host") == "0.0.0.0"
    assert flag(argv, "--base-gpu-id") == "2" and flag(argv, "--random-seed") == "7"
    assert sglang_target_modules(cfg) == argv[start:start + 7]


def test_seeded_sampling_needs_deterministic_inference_when_the_run_resumes_exactly():
    # SGLang reads a request's sampling_seed only with --enable-deterministic-inference; kora turns it on
    # when the run promises exact replay after a resume (checkpoints, synchronous rollouts)
    plain = sglang_command(config(), port=1).argv
    assert "--enable-deterministic-inference" not in plain
    exact = config(checkpoint={"path": "/ckpt"}, deployment={"async": False})
    assert "--enable-deterministic-inference" in sglang_command(exact, port=1).argv
    lagged = config(checkpoint={"path": "/ckpt"}, deployment={"async": True})  # exactness is not claimed
    assert "--enable-deterministic-inference" not in sglang_command(lagged, port=1).argv
    assert "--enable-deterministic-inference" in sglang_command(lagged, port=1, deterministic=True).argv
    assert "--enable-deterministic-inference" not in sglang_command(exact, port=1, deterministic=False).argv


def test_multi_lora_slots_count_the_base():
    argv = sglang_command(config(lora={"syncMode": "Adapter"}, multiLora={"maxAdapters": 4}), port=1).argv
    assert flag(argv, "--max-loras-per-batch") == "5"


def test_engine_merge_and_cpu_engines_are_refused_for_sglang():
    with pytest.raises(UnsupportedEngineConfig, match="EngineMerge"):
        sglang_command(config(lora={"syncMode": "EngineMerge"}), port=1)
    with pytest.raises(UnsupportedEngineConfig, match="engine hf"):
        sglang_command(config(rollout={"gpusPerEngine": 0}), port=1)


def test_sglang_gets_its_keys_from_a_private_config_file_not_argv(tmp_path):
    # SGLang reads no key from the environment; `launch_server --config F.yaml` turns F's `flag: value`
    # pairs into flags inside the process, so argv (what `ps` shows) names only the file
    tricky = "true"  # a YAML scalar that would not load as a string unquoted
    launch = sglang_command(config(), port=30002, api_key=tricky, admin_api_key="adm-123",
                            secrets_dir=str(tmp_path))
    argv = launch.argv
    assert tricky not in argv[argv.index("--port"):] and "adm-123" not in argv
    path = flag(argv, "--config")
    assert path.startswith(str(tmp_path)) and path.endswith(".yaml") and list(launch.secret_files) == [path]
    assert yaml.safe_load(launch.secret_files[path]) == {"api-key": "true", "admin-api-key": "adm-123"}
    assert "--config" not in sglang_command(config(), port=1).argv and not sglang_command(config(), port=1).secret_files


def test_hf_command_is_accepted_by_the_hf_engine_parser():
    cfg = config(lora={"syncMode": "Adapter"}, rollout={"engine": "hf", "gpusPerEngine": 0})
    launch = engine_command(cfg, port=31000, api_key="k", admin_api_key="adm", num_threads=1)
    assert launch.engine == "hf" and launch.argv[1:3] == ["-m", "kora_engine.lm"]
    assert "k" not in launch.argv and "adm" not in launch.argv and not launch.secret_files  # keys by environment
    args = engine_server.parse_args(launch.argv[3:], environ=launch.env)
    assert (args.model_path, args.port, args.device, args.max_lora_rank) == ("/models/qwen", 31000, "cpu", 16)
    assert (args.max_loras_per_batch, args.api_key, args.admin_api_key, args.num_threads) == (2, "k", "adm", 1)
    flagged = engine_server.parse_args([*launch.argv[3:], "--admin-api-key", "cli"], environ=launch.env)
    assert flagged.admin_api_key == "cli"  # a flag wins over the environment
    assert engine_server.parse_args(launch.argv[3:], environ={}).admin_api_key is None
    assert hf_engine_command(config(), port=1).argv[hf_engine_command(config(), port=1).argv.index("--device") + 1] \
        == "cuda"
    assert engine_command(config(), port=2).engine == "sglang"


def test_sglang_version_pin_is_reported():
    problem = sglang_version_problem()  # SGLang is not installed on CPU machines
    assert problem is None or SGLANG_REQUIREMENT in problem
    assert SGLANG_REQUIREMENT == "sglang==0.5.23"
