"""Shared test setup: make hack/ importable (hack/localcluster.py, a stdlib-only module) and
tests/ itself (shared helpers such as tests/specs.py), whatever pytest's import mode."""

import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
for _path in (TESTS_DIR.parent / "hack", TESTS_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
