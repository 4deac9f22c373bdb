"""Seed-compatible flags: a Relax/miles recipe's LoRA block ports over with the same rules."""

from __future__ import annotations

import pytest

from kora_trainer.config import ConfigError, load_config
from kora_trainer.config.flags import MODE_FLAGS_EXCLUSIVE, as_overrides, parse_seed_flags

BASE = {"model": {"path": "/m"}, "lora": {"rank": 4}, "data": {"path": "/d.jsonl"}}


def load(argv):
    cfg, warnings = load_config(None, as_overrides(parse_seed_flags(argv)), base=BASE)
    return cfg, warnings


def test_relax_adapter_recipe_block():
    cfg, warnings = load(
        [
            "--lora-rank",
            "128",
            "--lora-alpha",
            "64",
            "--lora-target-modules",
            "linear_qkv",
            "linear_proj",
            "--lora-dropout",
            "0.0",
            "--lora-adapter-mode",
            "--rollout-num-gpus-per-engine",
            "1",
            "--update-weight-buffer-size",
            "536870912",
        ]
    )
    assert cfg.lora.rank == 128 and cfg.lora.alpha == 64 and cfg.lora.sync_mode == "Adapter"
    assert [m.value for m in cfg.lora.target_modules] == ["linear_qkv", "linear_proj"]
    assert cfg.sync.buffer_size == 2**29 and warnings == []


def test_rule1_merge_and_adapter_flags_are_exclusive():
    with pytest.raises(ConfigError) as err:
        parse_seed_flags(["--lora-rank", "8", "--lora-merge-mode", "--lora-adapter-mode"])
    assert err.value.problems == [MODE_FLAGS_EXCLUSIVE]


def test_rule2_no_mode_flag_means_merge_with_a_warning():
    cfg, warnings = load(["--lora-rank", "8"])
    assert cfg.lora.effective_sync_mode == "Merge"
    assert [w.rule for w in warnings] == ["no-sync-mode"]


def test_rule3_via_flags():
    with pytest.raises(ConfigError, match=r"rollout\.dpSize 1"):
        load(["--lora-adapter-mode", "--sglang-dp-size", "2"])


def test_rule5_router_in_merge_mode_via_flags():
    with pytest.raises(ConfigError, match="router"):
        load(["--lora-merge-mode", "--lora-target-modules", "linear_qkv", "router"])


def test_rule8_save_lora_only_with_async_save_or_fp16():
    with pytest.raises(ConfigError, match="asyncSave"):
        load(["--save-lora-only", "--async-save"])
    with pytest.raises(ConfigError, match=r"checkpoint\.dtype"):
        load(["--save-lora-only", "--fp16"])


def test_rank_zero_is_explained():
    with pytest.raises(ConfigError, match="--lora-rank 1 or more"):
        parse_seed_flags(["--lora-rank", "0"])


def test_bad_flag_value_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot parse flags"):
        parse_seed_flags(["--lora-rank", "many"])


DIFFUSION_BASE = {**BASE, "rollout": {"engine": "hf", "gpusPerEngine": 0}, "diffusion": {"kind": "image"}}


def load_diffusion(argv):
    return load_config(None, as_overrides(parse_seed_flags(argv)), base=DIFFUSION_BASE)


def test_the_diffusion_seeds_recommended_block_ports_over():
    """miles-diffusion's recipe flags, as its LoRA page gives them, plus the optional ones."""
    cfg, warnings = load_diffusion(["--use-lora", "--lora-ipc-weight-sync", "--lora-rank", "32", "--lora-alpha", "64",
                                    "--colocate", "--lora-init-weights", "gaussian", "--update-weight-buffer-size",
                                    "2147483648", "--update-weight-target-module", "transformer",
                                    "--lora-target-modules", "to_q", "to_k", "to_v", "to_out.0"])
    assert warnings == [] and cfg.lora.sync_mode == "EngineMerge" and cfg.deployment.mode == "Colocate"
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.sync.buffer_size) == (32, 64, 2**31)
    assert cfg.diffusion is not None and cfg.diffusion.lora_init == "gaussian"
    assert [t.value for t in cfg.diffusion.target_modules] == ["to_q", "to_k", "to_v", "to_out.0"]
    assert cfg.lora.target_modules == BASE_TARGETS  # the language-model list is left as it was


BASE_TARGETS = load_config(None, [], base=BASE)[0].lora.target_modules


def test_the_seeds_rule_ipc_merge_needs_colocate():
    overrides = [*as_overrides(parse_seed_flags(["--lora-ipc-weight-sync"])), "deployment.mode=Disaggregated"]
    with pytest.raises(ConfigError, match=r"set deployment\.mode Colocate \(the seed's --colocate\)"):
        load_config(None, overrides, base=DIFFUSION_BASE)


def test_target_modules_of_both_vocabularies_at_once_are_refused_naming_both():
    with pytest.raises(ConfigError, match=r"--lora-target-modules linear_qkv to_q: give Megatron names .* diffusers"):
        parse_seed_flags(["--lora-target-modules", "linear_qkv", "to_q"])
