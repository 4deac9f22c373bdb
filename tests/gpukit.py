"""Marks shared by the GPU tests (tests/gpu): skipped without the GPUs or megatron-core they need."""

from __future__ import annotations

import pytest
import torch

from kora_trainer.backends.megatron import megatron_available


def megatron_marks(gpus: int = 1, timeout: int = 600) -> list[pytest.MarkDecorator]:
    """pytestmark of a megatron GPU test that needs `gpus` CUDA GPUs."""
    need = "a CUDA GPU" if gpus == 1 else f"{gpus} CUDA GPUs (one per rank)"
    return [pytest.mark.gpu, pytest.mark.timeout(timeout),
            pytest.mark.skipif(torch.cuda.device_count() < gpus, reason=f"needs {need}"),
            pytest.mark.skipif(not megatron_available(), reason="needs megatron-core")]
