"""Rewards: score one generated response against its reference answer.

`data.rewardType` picks one:
- `math`: the response's final answer (the last `\\boxed{...}`, else `#### x`, else "answer is x", else the
  last number) equals the label, as text after normalisation or as numbers;
- `deepscaler`: DeepScaleR's rule (rllm's RewardMathFn, slime's `deepscaler` rm): the solution is what
  follows the reasoning (`</think>`, or `###Response`); it must hold a `\\boxed{}` answer that equals the
  label — no delimiter or no box scores 0;
- `custom`: `data.customRewardPath` = a dotted path to `def reward(sample) -> float` taking a `Sample`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kora_trainer.config.sections import DataSpec, RewardType


@dataclass
class Sample:
    """What a reward function sees: one response to one prompt."""

    prompt: str
    response: str
    label: str
    index: int = 0  # the prompt's row in the dataset
    metadata: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[[Sample], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        rest = text[start:].split(maxsplit=1)  # "\boxed 5"
        return rest[1].split()[0] if len(rest) > 1 else None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:i]
    return None


def final_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0]
    m = re.search(r"answer is[:\s]*\$?([^\n$]+)", text, re.IGNORECASE)
    if m:
        return m.group(1).strip().rstrip(".")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    s = answer.strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    for junk in ("$", "\\!", "\\,", "\\;", "\\left", "\\right", " "):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac\{([^}]*)\}\{([^}]*)\}", r"\1/\2", s)
    return s.rstrip(".").lower()


def _as_number(s: str) -> float | None:
    s = s.replace(",", "")
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return float(num) / float(den)
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(answer: str | None, label: str) -> bool:
    if answer is None:
        return False
    a, b = normalize(answer), normalize(label)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and abs(x - y) <= 1e-6 * max(1.0, abs(y))


def math_reward(sample: Sample) -> float:
    return 1.0 if answers_match(final_answer(sample.response), sample.label) else 0.0


def deepscaler_reward(sample: Sample) -> float:
    response = sample.response
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.rsplit("###Response", 1)[1]
    else:
        return 0.0
    boxed = last_boxed(solution)
    labels = [last_boxed(sample.label) or sample.label]
    return 1.0 if boxed is not None and any(answers_match(boxed, lab) for lab in labels) else 0.0


def load_custom(dotted: str) -> RewardFn:
    """'pkg.module.func' -> the function; clear errors for a missing module or attribute."""
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"data.customRewardPath {dotted}: cannot import {module_name}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"data.customRewardPath {dotted}: {module_name} has no function {attr}")
    return fn  # type: ignore[no-any-return]


def reward_fn(data: DataSpec) -> RewardFn:
    if data.reward_type is RewardType.MATH:
        return math_reward
    if data.reward_type is RewardType.DEEPSCALER:
        return deepscaler_reward
    if data.custom_reward_path is None:
        raise ValueError("data.rewardType custom needs data.customRewardPath")
    return load_custom(data.custom_reward_path)
