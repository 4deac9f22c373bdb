"""The reference engine's test-only death switch (kora_engine/faults.py): a malformed value stops the engine
at start with the expected form, not later; unset, nothing is counted."""

from __future__ import annotations

import pytest

from kora_engine.faults import ExitAt, parse_exit_at


def test_exit_at_parses_route_and_count():
    assert parse_exit_at("/generate:3") == ("/generate", 3)
    assert parse_exit_at("/kora/fast_sync/push:1") == ("/kora/fast_sync/push", 1)
    assert parse_exit_at(None) is None and parse_exit_at("") is None
    assert ExitAt("").target is None


@pytest.mark.parametrize("bad", ["generate:3", "/generate", "/generate:0", "/generate:x"])
def test_exit_at_refuses_a_malformed_value(bad):
    with pytest.raises(ValueError, match=r"KORA_ENGINE_FAULT_EXIT_AT=.*expected '/route:n'"):
        parse_exit_at(bad)
