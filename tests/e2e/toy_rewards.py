"""A custom reward for the short end-to-end runs (loaded by dotted path in the Ray rollout worker).

The e2e toy is untrained, so exact-match rewards would all be 0, no advantage would be non-zero, the
adapter would never move and delta-skip would (rightly) skip every sync. This reward varies from the
first step: 1 when the response starts with an odd digit.
"""

import os
import threading
import time
from pathlib import Path

from kora_trainer.algorithm.rewards import Sample


def odd_first_digit(sample: Sample) -> float:
    return 1.0 if sample.response[:1] in ("1", "3", "5", "7", "9") else 0.0


def even_first_digit(sample: Sample) -> float:
    """The multi-LoRA runs' second adapter: a different reward from the same prompts."""
    return 1.0 if sample.response[:1] in ("0", "2", "4", "6", "8") else 0.0


_gate_lock = threading.Lock()
_gate_calls = 0


def odd_first_digit_gated(sample: Sample) -> float:
    """`odd_first_digit`, held after KORA_TEST_GATE_AFTER calls until the file KORA_TEST_GATE_FILE exists (bounded:
    120 s), so a test can look at a run that is between two steps for as long as it needs, then let it go on."""
    global _gate_calls
    with _gate_lock:
        _gate_calls += 1
        held = _gate_calls > int(os.environ["KORA_TEST_GATE_AFTER"])
    gate = Path(os.environ["KORA_TEST_GATE_FILE"])
    deadline = time.monotonic() + 120.0
    while held and not gate.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never opened the gate {gate}")
        time.sleep(0.05)  # a bounded poll of the gate file (another process makes it)
    return odd_first_digit(sample)
