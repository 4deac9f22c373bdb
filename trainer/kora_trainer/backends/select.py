"""Which training backend a job gets, and how many GPUs each Ray actor asks for.

Both are pure functions of the config and a few facts about the machine, so the CPU tests check every
branch; `orchestration/` calls them with the facts it reads (CUDA present, megatron-core importable, the
Ray cluster's GPU count).

Backend (`backend:` in the job):
- torch: HF `from_pretrained` + kora's LoRA; CPU, or one GPU.
- megatron: megatron-core GPTModel (`backends/megatron`); needs a CUDA GPU and megatron-core.
- auto: megatron when a GPU and megatron-core are there and the base is large (its weights take at least
  LARGE_MODEL_BYTES on disk: about 1 B parameters in bf16), torch otherwise. Small models gain nothing from
  megatron's parallel layers, and the torch backend also runs on CPU.

GPU placement (Ray `num_gpus` per actor; Ray then sets each actor's CUDA_VISIBLE_DEVICES, and an engine
process inherits its actor's):
- no GPU in the cluster: nothing asks for one (the CPU path);
- Colocate with in-memory sync: the trainer and its engines share one GPU (fractions that add up to 1);
- otherwise (Disaggregated, or Colocate's distributedEngines fed over NCCL): the trainer takes
  `parallelism` GPUs and each engine `rollout.gpusPerEngine` of its own, so the weight-update group never
  has two ranks on one GPU (NCCL refuses that).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kora_trainer.config import Backend, ConfigError, TrainerConfig
from kora_trainer.config.sections import Engine

if TYPE_CHECKING:
    from kora_trainer.backends.grpo_step import StepMetrics

LARGE_MODEL_BYTES = 2 * 1024**3
WEIGHT_SUFFIXES = (".safetensors", ".bin")


class PolicyBackend(Protocol):
    """What the training actor, the checkpoints and the weight sender need from a backend."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    version: int

    def train_step(self, batch: Any) -> StepMetrics: ...
    def logprobs(self, prompts: list[list[int]], responses: list[list[int]],
                 adapter: bool = True) -> list[list[float]]: ...
    def generator_states(self) -> dict[str, torch.Tensor]: ...
    def load_generator_states(self, states: dict[str, torch.Tensor]) -> None: ...
    def adapter_named(self) -> list[tuple[str, torch.Tensor]]: ...
    def check_lora_only(self) -> None: ...
    def peft_export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]: ...
    def make_sender(self, transport: Any) -> Any: ...


def weights_bytes(path: str | Path) -> int:
    """Bytes of the checkpoint's weight files (0 when the path is not a local directory)."""
    root = Path(path)
    if not root.is_dir():
        return 0
    return sum(f.stat().st_size for f in root.iterdir() if f.suffix in WEIGHT_SUFFIXES)


def resolve_backend(cfg: TrainerConfig, *, cuda: bool, megatron: bool, model_bytes: int) -> Backend:
    """torch or megatron for this job on this machine; an explicit choice that cannot run is an error."""
    if cfg.backend is Backend.MEGATRON:
        missing = [what for what, ok in (("a CUDA GPU", cuda), ("megatron-core (pip install 'kora[gpu]')", megatron))
                   if not ok]
        if missing:
            raise ConfigError([f"backend: megatron needs {' and '.join(missing)} on the trainer; "
                              "set backend: torch (or auto) to train with the torch backend here"])
        return Backend.MEGATRON
    if cfg.backend is Backend.TORCH:
        return Backend.TORCH
    return Backend.MEGATRON if cuda and megatron and model_bytes >= LARGE_MODEL_BYTES else Backend.TORCH


def check_actor_layout(cfg: TrainerConfig, backend: Backend) -> None:
    """The trainer runs as ONE process today: refuse actor layouts that need one process per GPU."""
    p = cfg.parallelism
    if p.actor_gpus > 1 or p.expert > 1:
        raise ConfigError([
            f"parallelism (data {p.data}, tensor {p.tensor}, pipeline {p.pipeline}, context {p.context}, "
            f"expert {p.expert}) needs one trainer process per GPU, which the trainer does not launch yet: set "
            "every parallelism size to 1 (bench/gpu_sync.py --tp runs the tensor-parallel actor)"])
    if backend is Backend.TORCH and (p.expert_tensor > 1):
        raise ConfigError(["parallelism.expertTensor > 1 needs backend: megatron"])


@dataclass(frozen=True)
class GpuShares:
    trainer: float
    engine: float  # per engine

    @property
    def total(self) -> float:
        return self.trainer + self.engine


def gpu_shares(cfg: TrainerConfig, colocated: bool, cluster_gpus: float) -> GpuShares:
    """Ray `num_gpus` for the trainer and for each engine (see the module docstring)."""
    engine_gpus = cfg.rollout.gpus_per_engine if cfg.rollout.engine is Engine.SGLANG else min(
        cfg.rollout.gpus_per_engine, 1)  # the reference engine uses one device
    if cluster_gpus <= 0:
        if cfg.rollout.engine is Engine.SGLANG or engine_gpus > 0:
            raise ConfigError([
                f"rollout.gpusPerEngine is {cfg.rollout.gpus_per_engine} but the Ray cluster has no GPU: set "
                "rollout.engine: hf and rollout.gpusPerEngine: 0 to run the reference engine on CPU, or add GPUs"])
        return GpuShares(0.0, 0.0)
    n = cfg.rollout.num_engines
    if colocated:
        if engine_gpus > 1:
            raise ConfigError([f"deployment Colocate shares one GPU between the trainer and its engines, but "
                              f"rollout.gpusPerEngine is {engine_gpus}: set it to 1, or use Disaggregated"])
        # one GPU: half for the trainer, the rest split between the engines (Ray packs fractions on one GPU)
        return GpuShares(0.5, 0.5 / n)
    trainer = float(cfg.parallelism.actor_gpus)
    need = trainer + n * engine_gpus
    if need > cluster_gpus:
        raise ConfigError([
            f"the trainer ({trainer:g} GPU) and {n} engine(s) of rollout.gpusPerEngine {engine_gpus} need "
            f"{need:g} GPUs, the Ray cluster has {cluster_gpus:g}: lower rollout.numEngines / gpusPerEngine, or "
            "use deployment.mode Colocate"])
    return GpuShares(trainer, float(engine_gpus))


def make_backend(cfg: TrainerConfig, threads: int | None = None) -> PolicyBackend:
    """The training backend for this job, built where the trainer runs (the process with the GPU)."""
    from kora_trainer.backends.megatron import megatron_available

    cuda = torch.cuda.is_available()
    backend = resolve_backend(cfg, cuda=cuda, megatron=cuda and megatron_available(),
                              model_bytes=weights_bytes(cfg.model.path))
    check_actor_layout(cfg, backend)
    if backend is Backend.MEGATRON:
        from kora_trainer.backends.megatron.backend import MegatronBackend

        return MegatronBackend(cfg)
    from kora_trainer.backends.torch_backend import TorchBackend

    return TorchBackend(cfg, threads=threads)
