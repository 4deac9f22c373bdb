"""The seed's multi-LoRA flags on the toy's own recipe (issue 44): `trainer/examples/toy.yaml` (cosine decay to 0)
with `--lora-adapter-mode --multi-lora-n-adapters auto --multi-lora-adapter NAME adapter.yaml ...`, as a new user
would type it, sizes its slots from the host's free memory and trains two adapters, each along the cosine over its
own step count; killed after both have a
checkpoint, the job started again resumes both and ends bit-identical to the uninterrupted job (async off, as the
single-adapter resume test: with async on, the step after a restart generates from a newer version).
The scheduler's arithmetic and its checkpoint round trip are CI-size in tests/unit/test_multi_lora_schedule_state.py."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from trainkit import TrainRun, wait_all

STEPS = {"odd": 6, "even": 9}
PEAK = yaml.safe_load((Path(__file__).resolve().parents[2] / "trainer/examples/toy.yaml").read_text())["algorithm"]


def seed_flags(toy_dir: Path, work: Path) -> list[str]:
    """What a user adds to the toy's command line: the seed's flags and one adapter.yaml per adapter."""
    work.mkdir(parents=True, exist_ok=True)
    flags = ["deployment.async=false", "--lora-adapter-mode", "--multi-lora-n-adapters", "auto", "--save",
             str(work / "ckpt"), "--save-interval", "2"]  # key=value overrides go before the flags
    for name, reward in (("odd", "odd_first_digit"), ("even", "even_first_digit")):
        body = {"rank": 16 if name == "odd" else 8, "data": str(toy_dir / "train.parquet"), "rm_type": "custom",
                "custom_rm_path": f"toy_rewards.{reward}", "num_step": STEPS[name], "rollout_batch_size": 4,
                "n_samples_per_prompt": 4}
        (work / f"{name}.yaml").write_text(yaml.safe_dump(body))
        flags += ["--multi-lora-adapter", name, str(work / f"{name}.yaml")]
    return flags


def factors(work: Path, name: str) -> dict:
    return load_file(str(work / "ckpt" / "adapters" / name / "lora_adapter" / "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.full
def test_the_seeds_flags_on_the_toy_train_two_cosine_schedules_and_resume_bit_exactly(toy_dir, tmp_path):
    straight = TrainRun(toy_dir, tmp_path / "straight", *seed_flags(toy_dir, tmp_path / "straight"))
    first = TrainRun(toy_dir, tmp_path / "crash", *seed_flags(toy_dir, tmp_path / "crash"))
    deadline = time.monotonic() + 300
    while not {e["adapter"] for e in first.events("adapter_checkpoint")} >= set(STEPS):
        assert first.running() and time.monotonic() < deadline, first.output[-3000:]
        time.sleep(0.1)
    first.kill()
    again = TrainRun(toy_dir, tmp_path / "crash-2", *seed_flags(toy_dir, tmp_path / "crash"))
    wait_all([straight, again])
    for run in (straight, again):
        assert {n: a["step"] for n, a in run.summary()["adapters"].items()} == STEPS, run.output[-3000:]
        # auto: slots sized from the host's MemAvailable (CPU), the arithmetic printed at start
        (sized,) = run.events("slots_sized")
        assert sized["max_adapters"] >= 2 and sized["arithmetic"][0].startswith("host MemAvailable")
        assert all(line in run.output for line in sized["arithmetic"])
    # each adapter's rate: the toy's cosine from its peak to minLr 0 over its own numSteps, at its own step
    rates = {n: {e["step"]: e["lr"] for e in straight.events("adapter_step") if e["adapter"] == n} for n in STEPS}
    for name, n in STEPS.items():
        want = {i + 1: PEAK["minLr"] + (PEAK["lr"] - PEAK["minLr"]) * (1 + math.cos(math.pi * i / n)) / 2
                for i in range(n)}
        assert rates[name] == pytest.approx(want, rel=1e-12), name
    resumed = {e["adapter"]: e["step"] for e in again.events("adapter_loaded")}
    assert all(resumed.get(n, 0) >= 2 for n in STEPS), resumed
    for e in again.events("adapter_step"):  # the resumed steps train at the uninterrupted run's rates
        assert e["lr"] == rates[e["adapter"]][e["step"]], e
    for name in STEPS:
        mine, ref = factors(tmp_path / "crash", name), factors(tmp_path / "straight", name)
        assert mine.keys() == ref.keys() and all(bool((mine[k] == ref[k]).all()) for k in ref), name
