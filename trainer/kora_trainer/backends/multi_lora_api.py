"""What a multi-LoRA trainer offers its worker (orchestration/multi_lora_workers.py), whichever backend holds the
base: `MultiLoRATrainer` (backends/multi_lora.py, the torch backend's HF model) and `MegatronMultiLoRATrainer`
(backends/megatron/multi_lora.py, megatron-core's parallel layers) both satisfy `MultiLoRA`, and the worker's
`multi_lora_trainer(backend)` picks the one for the backend the job built, so the worker never asks which it is.

Every call is made on every trainer rank: on megatron `adapter_named`, `peft_config`, `state` and `load_state`
gather (or split) the slot's tensors over the tensor-parallel, pipeline and expert-parallel groups.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kora_trainer.backends.batch import Padded
from kora_trainer.backends.data_parallel import DataParallel
from kora_trainer.config import TrainerConfig

if TYPE_CHECKING:
    from kora_trainer.backends.batch import RolloutBatch
    from kora_trainer.backends.multi_lora import AdapterStepMetrics
    from kora_trainer.config.adapter_runs import AdapterSettings
    from kora_trainer.lora.slots import Slot
    from kora_trainer.sync.slot_sender import SlotSender


class SlotBackend(Protocol):
    """What the slot trainers read off their backend (TorchBackend, MegatronBackend)."""

    cfg: TrainerConfig
    model: torch.nn.Module
    device: torch.device
    pad_id: int
    micro_batch_size: int
    max_grad_norm: float
    dp: DataParallel
    stages: DataParallel  # the pipeline group (size 1 without one)
    checkpoint_writer: bool  # the rank that writes checkpoints and exports (global rank 0)

    def _token_logp(self, p: Padded, temperature: float = 1.0) -> torch.Tensor: ...

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]], adapter: bool = True
                 ) -> list[list[float]]: ...


class MultiLoRA(Protocol):
    """Adapter slots on one frozen base, each with its own optimizer, step count and version."""

    backend: SlotBackend

    def add(self, settings: AdapterSettings) -> None: ...

    def remove(self, name: str) -> None: ...

    def names(self) -> list[str]: ...

    def step(self, name: str) -> int: ...

    def settings(self, name: str) -> AdapterSettings: ...

    def active(self, name: str) -> AbstractContextManager[Slot]: ...

    def train(self, batches: dict[str, RolloutBatch]) -> list[AdapterStepMetrics]: ...

    def pending(self, name: str) -> int: ...

    def drop_pending(self, name: str) -> None: ...

    def schedule_adapter(self, name: str, num_steps: int) -> dict[str, Any]: ...

    def adapter_named(self, name: str) -> list[tuple[str, torch.Tensor]]: ...

    def peft_config(self, name: str) -> dict[str, Any]: ...

    def logprobs(self, name: str, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]: ...

    def state(self, name: str) -> dict[str, Any]: ...

    def load_state(self, name: str, state: dict[str, Any]) -> None: ...

    def make_sender(self, transport: Any) -> SlotSender: ...

