"""rollout.sglangArgs: a user's own sglang.launch_server flags reach every engine after kora's, and the flags kora
derives from the spec, or any flag on the reference engine, are refused naming the field and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kora_trainer.config.rules import SGLANG_OWNED_FLAGS, SPEC_RULES
from kora_trainer.config.trainer import TrainerConfig
from kora_trainer.orchestration.sglang_launcher import hf_engine_command, sglang_command

TOY = Path(__file__).resolve().parents[2] / "trainer" / "examples" / "toy.yaml"


def config(**rollout: Any) -> TrainerConfig:
    spec = yaml.safe_load(TOY.read_text())
    spec["rollout"] = {**spec.get("rollout", {}), **rollout}
    return TrainerConfig.model_validate(spec)


def broken(cfg: TrainerConfig) -> dict[str, str]:
    return {r.id: r.text(cfg) for r in SPEC_RULES if r.violated(cfg)}


def test_the_users_flags_come_last_so_they_win_over_koras_defaults() -> None:
    cfg = config(engine="sglang", gpusPerEngine=1, sglangArgs=["--attention-backend", "triton",
                                                               "--mem-fraction-static", "0.3"])
    argv = sglang_command(cfg, 30000).argv
    assert argv[-4:] == ["--attention-backend", "triton", "--mem-fraction-static", "0.3"]
    assert not broken(cfg)


@pytest.mark.parametrize("arg", ["--port", "--model-path=/elsewhere", "--api-key", "--max-lora-rank=8"])
def test_a_flag_kora_sets_from_the_spec_is_refused_with_the_field(arg: str) -> None:
    problems = broken(config(engine="sglang", gpusPerEngine=1, sglangArgs=[arg, "1"]))
    assert "sglang-args-owned" in problems
    assert "rollout.sglangArgs" in problems["sglang-args-owned"] and arg.split("=")[0] in SGLANG_OWNED_FLAGS


def test_flags_on_the_reference_engine_are_refused_not_ignored() -> None:
    cfg = config(engine="hf", gpusPerEngine=0, sglangArgs=["--attention-backend", "triton"])
    assert "set rollout.engine to sglang" in broken(cfg)["sglang-args-engine"]
    assert "--attention-backend" not in hf_engine_command(cfg, 30000).argv
