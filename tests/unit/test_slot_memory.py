"""multiLora.maxAdapters auto (issue 44 item 5): one slot's bytes from config.json, the count the free memory
holds (config/slot_memory.py), the seed's flag, `kora plan`'s line, the registry sized at start, and
MemAvailable read as the host's free memory (orchestration/slot_sizing.py). The CRD's int-or-auto field against
the real API server is tests/integration/test_crd_apiserver.py's test_max_adapters_takes_a_count_or_auto."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kora_trainer.adapter_runs.registry import AdapterRegistry, RegistryError
from kora_trainer.config import ConfigError, TrainerConfig, load_config
from kora_trainer.config.flags import as_overrides, parse_seed_flags
from kora_trainer.config.placement import Node, plan_job
from kora_trainer.config.sections import AdapterRunConfig
from kora_trainer.config.slot_memory import Pool, plan_lines, pools, sized, slot_bytes, slot_elements
from kora_trainer.orchestration.slot_sizing import host_available_bytes, with_slots

# hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 128: per layer q 64+64, k 64+32, v 64+32, o 64+64,
# gate 64+128, up 64+128, down 128+64 = 1024 (in + out); x rank 8 x 2 layers = 16384 elements a slot
HF = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "intermediate_size": 128, "torch_dtype": "bfloat16"}
MiB = 2**20


def job(tmp_path: Path, **over: object) -> TrainerConfig:
    (tmp_path / "config.json").write_text(json.dumps(HF))
    base = {"model": {"path": str(tmp_path)}, "data": {"path": "d.parquet"},
            "lora": {"rank": 8, "syncMode": "Adapter",
                     "targetModules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]},
            "rollout": {"engine": "hf", "gpusPerEngine": 0}, "multiLora": {"maxAdapters": "auto"}}
    cfg, _ = load_config(None, [f"{k}={v}" for k, v in over.items()], base=base)
    return cfg


def test_one_slot_is_its_factor_elements_times_the_bytes_each_side_keeps(tmp_path):
    cfg = job(tmp_path)
    assert slot_elements(HF, cfg) == 16384
    assert slot_bytes(HF, cfg).trainer == 16384 * 16  # fp32 factor, grad, Adam m and v
    assert slot_bytes(HF, cfg).engine == 16384 * 4  # the reference engine on CPU: fp32
    gpu = job(tmp_path, **{"rollout.engine": "sglang", "rollout.gpusPerEngine": 2, "parallelism.tensor": 2,
                           "rollout.sglangBuild": "sglang-miles-94949da7"})
    assert slot_bytes(HF, gpu).trainer == 16384 * 16 // 2  # split like the modules over tensor parallel
    assert slot_bytes(HF, gpu).engine == 16384 * 2 // 2  # SGLang's pool in bf16, over its TP ranks


def test_an_moe_slot_on_a_trainer_rank_splits_its_experts_by_expert_parallel_not_tensor(tmp_path):
    """megatron's MoE slots (docs/multi_lora.md): every expert's factors, each on the expert-parallel rank that holds
    it and whole on its TP peers (expertTensor 1); the routers' whole on every TP rank."""
    moe = {**HF, "model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 32}
    cfg = job(tmp_path, **{"lora.targetModules": "[linear_fc1, linear_fc2, router]", "parallelism.tensor": 2,
                           "parallelism.expert": 2, "parallelism.data": 2})
    # per layer: gate_up 8 x 2 x (64 + 32), down 8 x (32 + 64), router 64 + 8; x rank 8 x 2 layers
    fc, router = (1536 + 768) * 16, 72 * 16
    assert slot_elements(moe, cfg) == fc + router
    assert slot_bytes(moe, cfg).trainer == (fc // 2 + router) * 16


def test_the_count_is_what_a_quarter_of_the_free_memory_after_the_bases_holds(tmp_path):
    """On CPU one host pays for every rank and engine: 0.25 x (1024 MiB - 2 x 100 MiB) = 206 MiB; less the
    engine's base-only buffer 0.0625 MiB, / (0.25 + 0.0625) MiB a slot = 659 -> capped at 256."""
    cfg = job(tmp_path)
    host = pools(cfg, slot_bytes(HF, cfg), 100 * MiB, 1024 * MiB, 1024 * MiB, world=1, trainer_gpu=False)
    assert len(host) == 1 and host[0].per_slot == 16384 * 20 and host[0].fixed == 16384 * 4
    assert host[0].slots() == int((0.25 * 824 * MiB - 16384 * 4) // (16384 * 20)) == 659
    n, lines = sized(host)
    assert n == 256 and lines[-1] == "multiLora.maxAdapters auto = 256 slot(s) (at most 256)"
    assert lines[0].startswith("host MemAvailable (1 trainer rank(s) + 1 CPU engine(s)): 0.25 x (1,024.0 MiB free")
    # disaggregated GPUs: each side its own count, the job the smaller
    gpu = job(tmp_path, **{"rollout.engine": "sglang", "rollout.gpusPerEngine": 1, "deployment.mode": "Disaggregated",
                           "rollout.sglangBuild": "sglang-miles-94949da7"})
    each = slot_bytes(HF, gpu)
    two = pools(gpu, each, 0, trainer_free=8 * MiB, engine_free=80 * MiB, world=1, trainer_gpu=True)
    assert [p.name for p in two] == ["trainer rank 0 GPU", "engine 0 GPU"]
    assert sized(two)[0] == int(0.25 * 8 * MiB // each.trainer) == 8
    # Colocate: trainer and engine share rank 0's GPU, one budget for both
    colo = job(tmp_path, **{"rollout.engine": "sglang", "rollout.gpusPerEngine": 1, "deployment.mode": "Colocate",
                            "rollout.sglangBuild": "sglang-miles-94949da7"})
    (shared,) = pools(colo, each, 0, trainer_free=8 * MiB, engine_free=8 * MiB, world=1, trainer_gpu=True)
    assert shared.per_slot == each.trainer + each.engine and shared.fixed == each.engine


def test_no_slot_is_refused_with_the_arithmetic():
    with pytest.raises(ConfigError, match=r"holds no adapter slot \(tiny: 0.25 x \(1.0 MiB free - 0.0 MiB base"):
        sized([Pool("tiny", MiB, 0, MiB)])


def test_the_seeds_flag_takes_auto_and_the_plan_prints_the_per_slot_bytes(tmp_path):
    values = parse_seed_flags(["--multi-lora-n-adapters", "auto"])
    assert values == {"multiLora.maxAdapters": "auto"}
    cfg = job(tmp_path, **dict(o.split("=", 1) for o in as_overrides(values)))
    assert cfg.multi_lora.max_adapters == "auto" and cfg.multi_lora.on
    (line,) = plan_lines(cfg, HF)
    assert "one slot = 16,384 LoRA elements at rank 8: 0.2 MiB per trainer rank" in line
    assert f"  {line}" in plan_job(cfg, [Node("local", 2.0, 0)]).lines()
    assert plan_lines(with_slots(cfg, 3), HF) == [] and with_slots(cfg, 3).multi_lora.slots == 3


def test_the_registry_takes_the_sized_count_and_refuses_one_its_adapters_do_not_fit(tmp_path):
    cfg = job(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    registry = AdapterRegistry(cfg)
    assert registry.max_adapters == 256  # auto: the most there may be, until sized at start
    for name in ("a", "b"):
        registry.register(name, AdapterRunConfig.model_validate({"rank": 4, "data": {"path": str(data)}}))
    with pytest.raises(RegistryError, match="auto sized 1 slot"):
        registry.size(with_slots(cfg, 1))
    registry.size(with_slots(cfg, 2))
    assert registry.max_adapters == 2 and registry.state().max_adapters == 2


def test_the_hosts_free_memory_is_mem_available(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:          100000 kB\nMemAvailable:    8000000 kB\n")
    assert host_available_bytes(str(meminfo)) == 8000000 * 1024
