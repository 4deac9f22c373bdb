"""Which backend a job trains with, and how many GPUs the trainer and each engine ask Ray for.

A user notices these as: `backend: megatron` on a machine that cannot run it fails at start with what is
missing and what to set instead; `auto` picks megatron only for a large model on a GPU; a disaggregated
job gets distinct GPUs for the trainer and each engine (NCCL refuses two ranks of one group on one GPU),
a colocated one shares a GPU, and a job that asks for more GPUs than the cluster has fails at once
instead of waiting forever for Ray to place it.
"""

from __future__ import annotations

import pytest

from kora_trainer.backends.select import (
    LARGE_MODEL_BYTES,
    check_actor_layout,
    make_backend,
    resolve_backend,
    weights_bytes,
)
from kora_trainer.config import Backend, ConfigError, load_config
from kora_trainer.config.placement import gpu_shares


def cfg(*overrides: str):
    base = ["model.path=/nonexistent/model", "data.path=unused.parquet", "rollout.engine=hf", "lora.rank=4"]
    config, _ = load_config(None, [*base, *overrides])
    return config


@pytest.mark.parametrize(("cuda", "megatron", "missing"), [
    (False, True, "a CUDA GPU"), (True, False, "megatron-core"), (False, False, "a CUDA GPU and megatron-core")])
def test_an_explicit_megatron_backend_that_cannot_run_says_what_is_missing(cuda, megatron, missing):
    with pytest.raises(ConfigError, match=rf"backend: megatron needs {missing}.*set backend: torch"):
        resolve_backend(cfg("backend=megatron"), cuda=cuda, megatron=megatron, model_bytes=10 * LARGE_MODEL_BYTES)
    assert resolve_backend(cfg("backend=megatron"), cuda=True, megatron=True, model_bytes=0) is Backend.MEGATRON


def test_auto_takes_megatron_only_for_a_large_model_on_a_gpu():
    auto = cfg()
    assert auto.backend is Backend.AUTO
    big, small = LARGE_MODEL_BYTES, LARGE_MODEL_BYTES - 1
    assert resolve_backend(auto, cuda=True, megatron=True, model_bytes=big) is Backend.MEGATRON
    assert resolve_backend(auto, cuda=True, megatron=True, model_bytes=small) is Backend.TORCH
    assert resolve_backend(auto, cuda=False, megatron=True, model_bytes=big) is Backend.TORCH
    assert resolve_backend(auto, cuda=True, megatron=False, model_bytes=big) is Backend.TORCH
    assert resolve_backend(cfg("backend=torch"), cuda=True, megatron=True, model_bytes=big) is Backend.TORCH


def test_weights_bytes_counts_only_weight_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 20)
    (tmp_path / "config.json").write_bytes(b"x" * 1000)
    assert weights_bytes(tmp_path) == 320
    assert weights_bytes(tmp_path / "missing") == 0


def test_unlaunched_layouts_are_refused_at_start_and_data_tensor_pipeline_and_expert_parallel_run():
    with pytest.raises(ConfigError, match=r"context 2: the trainer runs data, tensor, pipeline and expert "
                                          r"parallelism so far.*set them to 1"):
        check_actor_layout(cfg("parallelism.context=2"), Backend.MEGATRON)
    check_actor_layout(cfg("parallelism.pipeline=2"), Backend.MEGATRON)  # megatron's schedule, one actor a stage
    check_actor_layout(cfg("parallelism.pipeline=2", "parallelism.tensor=2", "parallelism.data=2"), Backend.MEGATRON)
    with pytest.raises(ConfigError, match=r"parallelism.pipeline 4 does not divide the model's 6 layers.*a divisor"):
        check_actor_layout(cfg("parallelism.pipeline=4"), Backend.MEGATRON, num_layers=6)
    check_actor_layout(cfg("parallelism.pipeline=3"), Backend.MEGATRON, num_layers=6)
    with pytest.raises(ConfigError, match=r"parallelism expertTensor 2: .*not launched yet") as refused:
        check_actor_layout(cfg("parallelism.data=4", "parallelism.expert=2", "parallelism.expertTensor=2"),
                           Backend.MEGATRON)
    assert "data 4" not in str(refused.value)  # only what is refused is named
    check_actor_layout(cfg("parallelism.data=2", "parallelism.expert=2"), Backend.MEGATRON, num_experts=8)
    # MoE at tensor > 1: attention split by TP under sequence parallelism, the experts whole (expertTensor 1)
    check_actor_layout(cfg("parallelism.tensor=2", "parallelism.data=2", "parallelism.expert=2"), Backend.MEGATRON,
                       num_experts=8)
    with pytest.raises(ConfigError, match=r"expert 2: the model has no experts per MoE layer.*1 for a dense model"):
        check_actor_layout(cfg("parallelism.data=2", "parallelism.expert=2"), Backend.MEGATRON, num_experts=0)
    with pytest.raises(ConfigError, match=r"expert 4: the model has 6 experts per MoE layer.*a divisor"):
        check_actor_layout(cfg("parallelism.data=4", "parallelism.expert=4"), Backend.MEGATRON, num_experts=6)
    with pytest.raises(ConfigError, match=r"tensor 2 needs backend: megatron"):
        check_actor_layout(cfg("parallelism.tensor=2"), Backend.TORCH)
    check_actor_layout(cfg("parallelism.tensor=2"), Backend.MEGATRON)  # megatron's TP layers, one actor a rank
    check_actor_layout(cfg("parallelism.tensor=2", "parallelism.data=2"), Backend.MEGATRON)
    with pytest.raises(ConfigError, match=r"pipeline 2 needs backend: megatron"):
        check_actor_layout(cfg("parallelism.pipeline=2"), Backend.TORCH)
    with pytest.raises(ConfigError, match=r"expert 4 x expertTensor 1 must divide .* = 2.*parallelism.data to a "
                                          r"multiple of 2"):
        check_actor_layout(cfg("parallelism.tensor=2", "parallelism.expert=4"), Backend.MEGATRON)
    check_actor_layout(cfg(), Backend.MEGATRON)  # the default layout runs
    check_actor_layout(cfg("parallelism.data=4"), Backend.TORCH)  # data parallel on either backend
    check_actor_layout(cfg("parallelism.data=4"), Backend.MEGATRON)


def test_expert_parallelism_reads_the_expert_count_as_each_checkpoint_writes_it(tmp_path):
    """transformers 5 saves Qwen3-MoE's expert count as `num_local_experts` (the published checkpoints say
    `num_experts`): a job at parallelism.expert 2 on a checkpoint saved either way starts, and a count that
    expert 2 does not divide is refused naming it, wherever config.json keeps it."""
    import json

    from kora_trainer.config import read_hf_config
    from kora_trainer.config.start_layout import config_experts
    from tinymodel import make_tiny_moe_model

    saved = read_hf_config(str(make_tiny_moe_model(tmp_path / "moe", layers=2)))
    assert saved is not None and "num_experts" not in saved  # what transformers 5 writes
    published = {k: v for k, v in saved.items() if k != "num_local_experts"} | {"num_experts": 8}
    nested = {"model_type": "qwen3_5_moe", "text_config": {"num_experts": 6}}  # a VL model's text tower
    job = cfg("parallelism.data=2", "parallelism.expert=2")
    for hf in (saved, published):
        assert config_experts(hf) == 8
        check_actor_layout(job, Backend.MEGATRON, hf["num_hidden_layers"], config_experts(hf))
    for hf, experts in ((nested, 6), ({"n_routed_experts": 64}, 64), ({"hidden_size": 64}, 0), ({}, None)):
        assert config_experts(hf) == experts
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps(saved | {"num_local_experts": 5}))
    with pytest.raises(ConfigError, match=r"expert 2: the model has 5 experts per MoE layer"):
        check_actor_layout(job, Backend.MEGATRON, 2, config_experts(read_hf_config(str(tmp_path / "odd"))))


def test_cpu_cluster_asks_for_no_gpu_and_refuses_gpu_engines():
    assert gpu_shares(cfg("rollout.gpusPerEngine=0"), cluster_gpus=0).total == 0
    with pytest.raises(ConfigError, match=r"gpusPerEngine is 1 but the Ray cluster has no GPU.*gpusPerEngine: 0"):
        gpu_shares(cfg("rollout.gpusPerEngine=1", "deployment.mode=Disaggregated"), cluster_gpus=0)


def test_colocated_shares_a_ranks_gpu_and_disaggregated_gets_its_own():
    two = ("rollout.numEngines=2", "rollout.gpusPerEngine=1")
    shared = gpu_shares(cfg(*two, "deployment.mode=Colocate"), cluster_gpus=1)
    assert (shared.trainer, shared.engine) == (0.5, 0.25)
    assert shared.trainer + 2 * shared.engine == 1.0  # Ray packs the three actors onto one GPU
    # data 2: one engine beside each rank, each pair on its own GPU
    beside = gpu_shares(cfg(*two, "deployment.mode=Colocate", "parallelism.data=2"), cluster_gpus=2)
    assert (beside.trainer, beside.engine) == (0.5, 0.5)
    with pytest.raises(ConfigError, match=r"needs 2 GPUs .* Ray cluster has 1"):
        gpu_shares(cfg(*two, "deployment.mode=Colocate", "parallelism.data=2"), cluster_gpus=1)
    apart = gpu_shares(cfg(*two, "deployment.mode=Disaggregated"), cluster_gpus=3)
    assert (apart.trainer, apart.engine) == (1.0, 1.0)
    with pytest.raises(ConfigError, match=r"needs 3 GPUs .* Ray cluster has 2"):
        gpu_shares(cfg(*two, "deployment.mode=Disaggregated"), cluster_gpus=2)
    spanning = gpu_shares(cfg("rollout.engine=sglang", "rollout.gpusPerEngine=2", "deployment.mode=Colocate",
                              "parallelism.data=2"), cluster_gpus=2)
    assert (spanning.trainer, spanning.engine) == (0.5, 0.0)  # handed its ranks' GPUs, it asks Ray for none


def test_make_backend_builds_the_torch_backend_on_cpu(tmp_path):
    from tinymodel import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny")
    backend = make_backend(cfg(f"model.path={model_dir}", "lora.rank=2", "lora.alpha=4"), threads=1)
    assert type(backend).__name__ == "TorchBackend"
    names = [n for n, _ in backend.adapter_named()]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    tensors, config, modules = backend.peft_export()
    assert set(tensors) == set(names) and config["r"] == 2 and modules


def test_multi_lora_on_megatron_starts_with_moe_expert_and_router_targets():
    """Megatron's adapter slots hold expert and router adapters too (tests/unit/test_megatron_multi_lora_moe.py)."""
    from kora_trainer.backends.select import check_actor_layout
    from kora_trainer.config import Backend, TrainerConfig

    cfg = TrainerConfig.model_validate({"model": {"path": "/m"}, "data": {"path": "/d.jsonl"},
                                        "lora": {"rank": 8, "syncMode": "Adapter", "targetModules": [
                                            "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "router"]},
                                        "multiLora": {"maxAdapters": 2}})
    for backend in (Backend.MEGATRON, Backend.TORCH):
        check_actor_layout(cfg, backend)
    check_actor_layout(cfg, Backend.MEGATRON, num_experts=0)
    check_actor_layout(cfg, Backend.MEGATRON, num_experts=8)
    expert2 = cfg.parallelism.model_copy(update={"expert": 2, "data": 2})
    check_actor_layout(cfg.model_copy(update={"parallelism": expert2}), Backend.MEGATRON, num_experts=8)


def test_auto_keeps_a_model_megatron_does_not_map_on_torch_and_megatron_refuses_it():
    """A large Qwen3.5 hybrid (GDN layers: model_type qwen3_5_text) on a GPU: auto trains it with the torch backend,
    an explicit backend: megatron stops at start naming the model type and the fix, not at the model builder."""
    big = 10 * LARGE_MODEL_BYTES
    auto = resolve_backend(cfg(), cuda=True, megatron=True, model_bytes=big, model_type="qwen3_5_text")
    assert auto is Backend.TORCH
    assert resolve_backend(cfg(), cuda=True, megatron=True, model_bytes=big, model_type="qwen3") is Backend.MEGATRON
    with pytest.raises(ConfigError, match=r"backend: megatron maps model_type .*not 'qwen3_5_text'.*backend: torch"):
        resolve_backend(cfg("backend=megatron"), cuda=True, megatron=True, model_bytes=big, model_type="qwen3_5_text")


def test_a_vision_language_model_is_refused_on_megatron_at_start_whatever_the_machine():
    big = 10 * LARGE_MODEL_BYTES
    # auto keeps it on torch even where megatron would take a text model of its type
    assert resolve_backend(cfg(), cuda=True, megatron=True, model_bytes=big, model_type="qwen3",
                           vision=True) is Backend.TORCH
    for cuda, megatron in ((True, True), (False, False)):  # refused first: no GPU is needed to know
        with pytest.raises(ConfigError, match=r"backend: megatron has no vision tower .* model_type 'qwen3_5'.*"
                                              r"set backend: torch"):
            resolve_backend(cfg("backend=megatron"), cuda=cuda, megatron=megatron, model_bytes=big,
                            model_type="qwen3_5", vision=True)
