"""A custom reward for the short end-to-end runs (loaded by dotted path in the Ray rollout worker).

The e2e toy is untrained, so exact-match rewards would all be 0, no advantage would be non-zero, the
adapter would never move and delta-skip would (rightly) skip every sync. This reward varies from the
first step: 1 when the response starts with an odd digit.
"""

from kora_trainer.algorithm.rewards import Sample


def odd_first_digit(sample: Sample) -> float:
    return 1.0 if sample.response[:1] in ("1", "3", "5", "7", "9") else 0.0


def even_first_digit(sample: Sample) -> float:
    """The multi-LoRA runs' second adapter: a different reward from the same prompts."""
    return 1.0 if sample.response[:1] in ("0", "2", "4", "6", "8") else 0.0
