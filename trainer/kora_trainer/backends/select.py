"""Which training backend a job gets, and which actor layouts the trainer refuses at start.

Both are pure functions of the config and a few facts about the machine, so the CPU tests check every
branch; `orchestration/` calls them with the facts it reads (CUDA present, megatron-core importable).
How many GPUs each Ray actor asks for is config/placement.py's (`gpu_shares`).

Backend (`backend:` in the job):
- torch: HF `from_pretrained` + kora's LoRA; CPU, or one GPU per rank.
- megatron: megatron-core GPTModel (`backends/megatron`); needs a CUDA GPU and megatron-core.
- auto: megatron when a GPU and megatron-core are there and the base is large (its weights take at least
  LARGE_MODEL_BYTES on disk: about 1 B parameters in bf16), torch otherwise. Small models gain nothing from
  megatron's parallel layers, and the torch backend also runs on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kora_trainer.backends.data_parallel import RankContext
from kora_trainer.backends.megatron import megatron_available
from kora_trainer.backends.torch_backend import TorchBackend
from kora_trainer.config import Backend, ConfigError, TrainerConfig, read_hf_config
from kora_trainer.config.start_layout import MEGATRON_MODEL_TYPES, actor_layout_problems, config_experts, megatron_maps

if TYPE_CHECKING:
    from kora_trainer.backends.grpo_step import StepMetrics
    from kora_trainer.sync.sender import WeightSender

LARGE_MODEL_BYTES = 2 * 1024**3
WEIGHT_SUFFIXES = (".safetensors", ".bin")


class PolicyBackend(Protocol):
    """What the training actor, the checkpoints and the weight sender need from a backend."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    version: int
    checkpoint_writer: bool  # the rank that writes checkpoints and the export (rank 0)
    checkpoint_shards: Any  # tensor-parallel shards to gather into a checkpoint (megatron/tp_checkpoint.py), or None

    def train_step(self, batch: Any) -> StepMetrics: ...
    def logprobs(self, prompts: list[list[int]], responses: list[list[int]],
                 adapter: bool = True) -> list[list[float]]: ...
    def generator_states(self) -> dict[str, torch.Tensor]: ...
    def load_generator_states(self, states: dict[str, torch.Tensor]) -> None: ...
    def adapter_named(self) -> list[tuple[str, torch.Tensor]]: ...
    def check_lora_only(self) -> None: ...
    def peft_export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]: ...
    def make_sender(self, transport: Any) -> WeightSender: ...  # production's; sync/fast/path.py may wrap it


def weights_bytes(path: str | Path) -> int:
    """Bytes of the checkpoint's weight files (0 when the path is not a local directory)."""
    root = Path(path)
    if not root.is_dir():
        return 0
    return sum(f.stat().st_size for f in root.iterdir() if f.suffix in WEIGHT_SUFFIXES)


VISION_ON_MEGATRON = (
    "backend: megatron has no vision tower (the megatron backend builds a text-only GPTModel), and model.path "
    "{path} is a vision-language model (its config.json declares vision_config, model_type {model_type!r}): set "
    "backend: torch (or auto, which trains a VL model on torch)")


def resolve_backend(cfg: TrainerConfig, *, cuda: bool, megatron: bool, model_bytes: int,
                    model_type: str | None = None, vision: bool = False) -> Backend:
    """torch or megatron for this job on this machine; an explicit choice that cannot run is an error. `model_type`:
    the checkpoint's config.json model_type (None: unread); auto keeps a model megatron does not map on torch;
    `vision`: config.json declares a vision tower (megatron is refused first, whatever the machine)."""
    mapped = megatron_maps(model_type, vision)
    if cfg.backend is Backend.MEGATRON and vision:
        raise ConfigError([VISION_ON_MEGATRON.format(path=cfg.model.path, model_type=model_type)])
    if cfg.backend is Backend.MEGATRON:
        missing = [what for what, ok in (("a CUDA GPU", cuda), ("megatron-core (pip install 'kora[gpu]')", megatron))
                   if not ok]
        if missing:
            raise ConfigError([f"backend: megatron needs {' and '.join(missing)} on the trainer; "
                              "set backend: torch (or auto) to train with the torch backend here"])
        if not mapped:
            raise ConfigError([f"backend: megatron maps model_type {', '.join(sorted(MEGATRON_MODEL_TYPES))}, not "
                               f"{model_type!r} (model.path's config.json); set backend: torch (or auto)"])
        return Backend.MEGATRON
    if cfg.backend is Backend.TORCH:
        return Backend.TORCH
    return Backend.MEGATRON if cuda and megatron and mapped and model_bytes >= LARGE_MODEL_BYTES else Backend.TORCH


def check_actor_layout(cfg: TrainerConfig, backend: Backend, num_layers: int | None = None,
                       num_experts: int | None = None) -> None:
    """Refuse, at start, a layout this trainer would not train as asked (config/start_layout.py: `kora plan` says
    the same lines)."""
    if problems := actor_layout_problems(cfg, backend, num_layers, num_experts):
        raise ConfigError(problems)


def make_backend(cfg: TrainerConfig, threads: int | None = None, rank: RankContext | None = None) -> PolicyBackend:
    """The training backend for this job, built where the trainer rank runs (the process with the GPU); with
    several ranks `rank` says where the trainer's process group meets."""
    cuda = torch.cuda.is_available()
    hf = read_hf_config(cfg.model.path) or {}
    backend = resolve_backend(cfg, cuda=cuda, megatron=cuda and megatron_available(),
                              model_bytes=weights_bytes(cfg.model.path), model_type=hf.get("model_type"),
                              vision=bool(hf.get("vision_config")))
    check_actor_layout(cfg, backend, hf.get("num_hidden_layers"), config_experts(hf))
    if backend is Backend.MEGATRON:
        from kora_trainer.backends.megatron.backend import MegatronBackend  # noqa: PLC0415 - the megatron backend's modules (and Triton fold) only when chosen

        return MegatronBackend(cfg, rank=rank)

    return TorchBackend(cfg, threads=threads, rank=rank)
