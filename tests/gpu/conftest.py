"""Fixtures shared by the GPU tests (they are skipped without a GPU; see each file's pytestmark)."""

from __future__ import annotations

import pytest

from tinymodel import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny dense Qwen3 of tests/tinymodel.py, on disk."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))
