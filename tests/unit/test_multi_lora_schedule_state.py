"""A schedule per adapter (issue 44 item 4): in a multi-adapter job each adapter's rate follows the job's
lrDecayStyle family (or its own fields) on its own step count, and the schedule rides in its checkpoint, so a
resumed adapter goes on along the same curve bit for bit. The trainer's slots on a tiny model, no Ray (the whole
job through the seed's flags is tests/e2e/test_multi_lora.py's schedule test)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kora_trainer.algorithm.lr_schedule import lr_at
from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.backends.multi_lora import MultiLoRATrainer
from kora_trainer.backends.torch_backend import TorchBackend
from kora_trainer.checkpoint.adapter_slot import load_slot, save_slot
from kora_trainer.config import TrainerConfig, adapter_problems, load_config
from kora_trainer.config.adapter_runs import resolve
from kora_trainer.config.load import read_hf_config
from kora_trainer.config.sections import AdapterRunConfig
from kora_trainer.config.slot_memory import slot_elements
from tinymodel import make_tiny_model

PROMPT = [1, 4, 5, 13, 6, 7, 14]
GOOD, BAD = [5, 6, 7, 2], [8, 8, 8, 2]
LR = 0.02


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def job(model_dir, **algorithm) -> TrainerConfig:
    alg = {"lr": LR, "lrDecayStyle": "cosine", "rolloutBatchSize": 1, "nSamplesPerPrompt": 2,
           "globalBatchSize": 2, **algorithm}
    cfg, _ = load_config(None, [], base={
        "model": {"path": str(model_dir)}, "data": {"path": "unused.parquet"},
        "lora": {"rank": 4, "alpha": 8, "syncMode": "Adapter"}, "algorithm": alg, "multiLora": {"maxAdapters": 2},
        "rollout": {"engine": "hf", "gpusPerEngine": 0}})
    return cfg


def trainer(cfg: TrainerConfig, adapters: dict[str, dict]) -> MultiLoRATrainer:
    multi = MultiLoRATrainer(TorchBackend(cfg, device="cpu", threads=1))
    for slot, (name, spec) in enumerate(adapters.items()):
        multi.add(resolve(cfg, name, AdapterRunConfig.model_validate({"data": {"path": "d.parquet"}, **spec}), slot))
    return multi


def step(multi: MultiLoRATrainer, name: str) -> float:
    lps = multi.logprobs(name, [PROMPT] * 2, [GOOD, BAD])
    (m,) = multi.train({name: RolloutBatch([PROMPT] * 2, [GOOD, BAD], lps, [1.0, 0.0], group_size=2)})
    return m.lr


def test_each_adapter_decays_over_its_own_step_count(model_dir):
    """The job's cosine, two adapters of 3 and 6 steps trained in turn: each one's rate is lr x (1 + cos(pi i /
    its numSteps)) / 2 at its own step i, whatever the other has done; an adapter's own fields override the job's."""
    cfg = job(model_dir)
    multi = trainer(cfg, {"short": {"rank": 4, "numSteps": 3},
                          "long": {"rank": 2, "numSteps": 6, "lr": 0.01, "lrWarmupSteps": 2}})
    assert multi.schedule_adapter("short", 3)["lr_decay_steps"] == 3
    assert multi.schedule_adapter("long", 6)["lr_decay_steps"] == 6
    rates: dict[str, list[float]] = {"short": [], "long": []}
    for name in ["long", "short", "long", "long", "short", "long", "short", "long", "long"]:
        rates[name].append(step(multi, name))
    assert rates["short"] == pytest.approx([LR * (1 + math.cos(math.pi * i / 3)) / 2 for i in range(3)], rel=1e-12)
    warm = [0.01 * (i + 1) / 2 for i in range(2)]  # its own warmup, then its cosine from step 2 to step 6
    assert rates["long"] == pytest.approx(warm + [0.01 * (1 + math.cos(math.pi * (i - 2) / 4)) / 2
                                                  for i in range(2, 6)], rel=1e-12)


def test_the_schedule_rides_in_the_checkpoint_and_a_resume_is_bit_exact(model_dir, tmp_path):
    """Saved at step 2 of 5 (save_slot / load_slot, the adapter checkpoint's files), a fresh trainer restores the
    schedule (a later schedule_adapter with another count keeps it) and ends bit-identical to the straight run."""
    cfg = job(model_dir)
    straight = trainer(cfg, {"a": {"rank": 4, "numSteps": 5}})
    straight.schedule_adapter("a", 5)
    for _ in range(2):
        step(straight, "a")
    save_slot(tmp_path, "a", copy.deepcopy(straight.state("a")), data_position=2, meta={})
    straight_rates = [step(straight, "a") for _ in range(3)]

    resumed = trainer(cfg, {"a": {"rank": 4, "numSteps": 5}})
    state, position = load_slot(tmp_path, "a")  # type: ignore[misc]
    resumed.load_state("a", state)
    assert state["schedule"]["num_steps"] == 5 and position == 2
    assert resumed.schedule_adapter("a", 50)["lr_decay_steps"] == 5  # the checkpoint's curve, not a new one
    assert [step(resumed, "a") for _ in range(3)] == straight_rates
    assert straight_rates == [lr_at(straight.adapters["a"].schedule, i) for i in (2, 3, 4)]  # type: ignore[arg-type]
    for (n, mine), (_, ref) in zip(resumed.adapter_named("a"), straight.adapter_named("a"), strict=True):
        assert torch.equal(mine, ref), n


def test_an_adapters_schedule_is_checked_against_its_own_numbers(model_dir):
    """min-lr and lr-warmup-steps, per adapter: its minLr above its lr, its warmup as long as its decay."""
    cfg = job(model_dir, minLr=1e-3)
    low = AdapterRunConfig.model_validate({"rank": 2, "lr": 1e-4, "numSteps": 10, "data": {"path": "d"}})
    warm = AdapterRunConfig.model_validate({"rank": 2, "lrWarmupSteps": 10, "numSteps": 10, "data": {"path": "d"}})
    ok = AdapterRunConfig.model_validate({"rank": 2, "lrWarmupSteps": 9, "numSteps": 10, "data": {"path": "d"}})

    def ids(c: AdapterRunConfig) -> list[str]:
        return [p.rule for p in adapter_problems(cfg, name="x", rank=2, rollout_batch_size=1,
                                                 n_samples_per_prompt=2, config=c)]
    assert ids(low) == ["adapter-min-lr"] and ids(warm) == ["adapter-lr-warmup-steps"] and ids(ok) == []


def test_auto_counts_the_elements_a_slot_really_holds(model_dir):
    """multiLora.maxAdapters auto's arithmetic (config/slot_memory.py, from config.json) against a slot the trainer
    made: the same factor elements at lora.rank."""
    cfg = job(model_dir)
    multi = trainer(cfg, {"a": {"rank": 4}})
    held = sum(p.numel() for p in multi.slots.slots["a"].params)
    assert slot_elements(read_hf_config(str(model_dir)) or {}, cfg) == held > 0
