"""Rewards: math final-answer match, the deepscaler rule, custom functions by dotted path."""

from __future__ import annotations

import pytest

from kora_trainer.algorithm.rewards import (
    Sample,
    deepscaler_reward,
    final_answer,
    last_boxed,
    load_custom,
    math_reward,
    reward_fn,
)
from kora_trainer.config.sections import DataSpec


def s(response: str, label: str) -> Sample:
    return Sample(prompt="q", response=response, label=label)


@pytest.mark.parametrize(("response", "label", "expected"), [
    ("052", "052", 1.0),  # the toy: the response is the answer
    ("053", "052", 0.0),
    ("05", "052", 0.0),
    ("", "052", 0.0),
    ("so the total is \\boxed{\\frac{1}{2}}.", "1/2", 1.0),
    ("\\boxed{0.5}", "\\frac12", 0.0),  # \frac12 (no braces) is not parsed: no partial credit by accident
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the LAST box counts
    ("#### 1,234", "1234", 1.0),
    ("The answer is 42.", "42", 1.0),
    ("7 apples and 9 pears, 16", "16", 1.0),
    ("\\boxed{x^{2}+1}", "x^{2} + 1", 1.0),
])
def test_math(response, label, expected):
    assert math_reward(s(response, label)) == expected


def test_boxed_braces_balance():
    assert last_boxed("\\boxed{\\frac{a}{b}} tail") == "\\frac{a}{b}"
    assert last_boxed("no box") is None
    assert final_answer("nothing numeric") is None


@pytest.mark.parametrize(("response", "expected"), [
    ("<think>it is 5</think> so \\boxed{5}", 1.0),
    ("<think>\\boxed{5}</think> so \\boxed{6}", 0.0),  # only the part after the reasoning counts
    ("\\boxed{5}", 0.0),  # no reasoning delimiter: format error
    ("<think>5</think> it is 5", 0.0),  # no box: format error
    ("###Response \\boxed{5}", 1.0),
])
def test_deepscaler(response, expected):
    assert deepscaler_reward(s(response, "5")) == expected


def length_reward(sample: Sample) -> float:
    """A custom reward (imported by dotted path in the test below)."""
    return float(len(sample.response))


def test_custom_by_dotted_path():
    fn = reward_fn(DataSpec(path="x.parquet", reward_type="custom", custom_reward_path="test_rewards.length_reward"))
    assert fn(s("abc", "")) == 3.0
    assert reward_fn(DataSpec(path="x.parquet")) is math_reward
    with pytest.raises(ValueError, match="cannot import"):
        load_custom("no_such_module_kora.reward")
    with pytest.raises(ValueError, match="has no function"):
        load_custom("test_rewards.missing")
