"""The learning-rate schedule (algorithm/lr_schedule.py): the rate each step trains at, warmup and decay, and the
seed's Megatron flags that set it."""

from __future__ import annotations

import itertools
import math

import pytest

from kora_trainer.algorithm.lr_schedule import lr_at
from kora_trainer.config.flags import parse_seed_flags
from kora_trainer.config.sections import AlgorithmSpec


def alg(**kw):
    return AlgorithmSpec.model_validate({"lr": 1e-3, "numSteps": 101, **kw})


def test_constant_is_the_rate_every_step_and_the_default():
    a = alg()
    assert [lr_at(a, i) for i in (0, 50, 100, 10**6)] == [1e-3] * 4


def test_warmup_rises_to_lr_then_holds():
    a = alg(lrWarmupSteps=4)
    assert [lr_at(a, i) for i in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_a_decay_falls_from_lr_to_min_lr_at_decay_steps_and_stays(style):
    a = alg(lrDecayStyle=style, minLr=1e-4, numSteps=100)
    rates = [lr_at(a, i) for i in range(101)]
    assert rates[0] == 1e-3 and rates[100] == pytest.approx(1e-4)
    assert rates[99] > 1e-4  # the run's last step (index 99) still trains: Megatron's convention
    assert all(x > y for x, y in itertools.pairwise(rates))  # strictly falling
    assert lr_at(a, 500) == pytest.approx(1e-4)
    half = 1e-4 + 0.9e-3 * (0.5 if style == "linear" else 0.5 * (1 + math.cos(math.pi / 2)))
    assert rates[50] == pytest.approx(half)


def test_lr_decay_steps_overrides_num_steps_and_the_warmup_comes_first():
    a = alg(lrDecayStyle="cosine", lrWarmupSteps=10, lrDecaySteps=60)
    assert lr_at(a, 9) == pytest.approx(1e-3) and lr_at(a, 10) == pytest.approx(1e-3)
    assert lr_at(a, 35) == pytest.approx(0.5e-3)  # half way from the warmup's end (index 10) to index 60
    assert lr_at(a, 60) == pytest.approx(0.0) and lr_at(a, 100) == pytest.approx(0.0)


def test_the_seeds_megatron_flags_set_the_schedule():
    got = parse_seed_flags(["--lr", "1e-5", "--lr-decay-style", "cosine", "--min-lr", "1e-6",
                            "--lr-warmup-iters", "20", "--lr-decay-iters", "500"])
    a = AlgorithmSpec.model_validate({k.removeprefix("algorithm."): v for k, v in got.items()})
    assert (a.lr_decay_style, a.min_lr, a.lr_warmup_steps, a.lr_decay_steps) == ("cosine", 1e-6, 20, 500)
