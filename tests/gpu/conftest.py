"""Fixtures shared by the GPU tests (they are skipped without a GPU; see each file's pytestmark)."""

from __future__ import annotations

import pytest
import torch

from tinymodel import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny dense Qwen3 of tests/tinymodel.py, on disk."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def parallel():
    """megatron initialised at TP = 1 in this process (fp32 without TF32), torn down after the module."""
    from kora_trainer.backends.megatron.parallel import destroy_parallel, init_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    init_parallel(1)
    yield
    destroy_parallel()
