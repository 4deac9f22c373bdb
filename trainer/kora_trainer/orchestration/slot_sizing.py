"""`multiLora.maxAdapters: auto` at start: the free memory measured where the job runs (a Ray task in trainer rank
0's bundle, and in engine 0's when the engines have memory of their own), before the models load, and
config/slot_memory.py's arithmetic on it. Runs after the placement group is ready and before the engines start,
since SGLang's LoRA pool is allocated at launch for maxAdapters + 1 adapters."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kora_trainer.backends.select import weights_bytes
from kora_trainer.config.load import read_hf_config
from kora_trainer.config.slot_memory import pools, sized, slot_bytes
from kora_trainer.config.trainer import TrainerConfig

if TYPE_CHECKING:
    from kora_trainer.orchestration.cluster import Placed


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The host's available memory (MemAvailable: free plus what the kernel can reclaim without swapping)."""
    for line in Path(meminfo).read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable line")


def free_bytes() -> tuple[int, bool]:
    """(free bytes, on a GPU) where this process runs: the GPU Ray gave it, else the host's available memory."""
    if torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0]), True
    return host_available_bytes(), False


def size_slots(placed: Placed) -> tuple[Placed, list[str]]:
    """The placed job with maxAdapters auto replaced by the count its memory holds, and the arithmetic."""
    import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

    cfg, plan = placed.cfg, placed.plan

    def measured(bundle: int, gpus: float) -> tuple[int, bool]:
        task = ray.remote(num_cpus=0, num_gpus=gpus)(free_bytes)
        got: tuple[int, bool] = ray.get(task.options(scheduling_strategy=placed.bundle(bundle)).remote())
        return got

    trainer_free, trainer_gpu = measured(plan.rank_bundle[0], plan.shares.trainer)
    engine_free = trainer_free
    if not plan.colocated and plan.engine_bundle:
        engine_free, _ = measured(plan.engine_bundle[0], plan.shares.engine)
    hf = read_hf_config(cfg.model.path) or {}
    found = pools(cfg, slot_bytes(hf, cfg), weights_bytes(cfg.model.path), trainer_free, engine_free,
                  len(plan.rank_bundle), trainer_gpu)
    n, lines = sized(found)
    return dataclasses.replace(placed, cfg=with_slots(cfg, n)), lines


def with_slots(cfg: TrainerConfig, n: int) -> TrainerConfig:
    return cfg.model_copy(update={"multi_lora": cfg.multi_lora.model_copy(update={"max_adapters": n})})
