"""What the trainer refuses at start about a job's layout, as a pure function of the config, so `kora plan` can say
it before a cluster is asked for (backends/select.check_actor_layout raises the same lines at start).

Data parallelism runs on both backends (one Ray actor per rank); tensor parallelism on megatron's layers (every TP
rank a Ray actor of one node), pipeline parallelism through megatron's schedule (backends/megatron/pipeline.py) and
expert parallelism on an MoE model's experts (carved out of the data and TP ranks; the experts are never split by TP,
and every model at tensor > 1 trains under sequence parallelism); context parallelism and expertTensor > 1 are not
launched yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kora_trainer.config.layout import parallel_problems
from kora_trainer.config.trainer import Backend, TrainerConfig

# The HF model types the megatron backend maps onto a GPTModel (backends/megatron/model.py `check_supported`); a
# Qwen3.5 hybrid (GDN linear-attention layers, model_type qwen3_5*) is not one of them.
MEGATRON_MODEL_TYPES = frozenset({"qwen3", "qwen2", "llama", "qwen3_moe"})


def megatron_maps(model_type: str | None, vision: bool) -> bool:
    """Whether the megatron backend can build this checkpoint (model_type None: unread, taken as mapped)."""
    return (model_type is None or model_type in MEGATRON_MODEL_TYPES) and not vision


def actor_layout_problems(cfg: TrainerConfig, backend: Backend, num_layers: int | None = None,
                          num_experts: int | None = None) -> list[str]:
    """One line per layout this trainer would not train as asked on `backend` (empty: it starts); `num_layers`,
    `num_experts`: the model's decoder layers and experts per MoE layer (0: dense), where its config was read."""
    p = cfg.parallelism
    problems = parallel_problems(p)
    if num_layers and p.pipeline > 1 and num_layers % p.pipeline:
        problems.append(f"parallelism.pipeline {p.pipeline} does not divide the model's {num_layers} layers (each "
                        "stage holds an equal share): set parallelism.pipeline to a divisor of num_hidden_layers")
    if p.expert > 1 and num_experts is not None and (num_experts == 0 or num_experts % p.expert):
        problems.append(f"parallelism.expert {p.expert}: the model has {num_experts or 'no'} experts per MoE layer, "
                        "which expert parallelism must divide: set parallelism.expert to a divisor of num_experts "
                        "(1 for a dense model)")
    split = {name: size for name, size in (("tensor", p.tensor), ("pipeline", p.pipeline), ("context", p.context),
                                           ("expert", p.expert), ("expertTensor", p.expert_tensor)) if size > 1}
    if split and backend is Backend.TORCH:
        problems.append(f"parallelism {', '.join(f'{k} {v}' for k, v in split.items())} needs backend: megatron "
                        "(megatron-core's parallel layers, on GPUs); the torch backend splits the data only: set "
                        "backend: megatron on a GPU cluster, or those sizes to 1 and raise parallelism.data")
    elif unlaunched := {k: v for k, v in split.items() if k not in ("tensor", "pipeline", "expert")}:
        problems.append(f"parallelism {', '.join(f'{k} {v}' for k, v in unlaunched.items())}: the trainer runs data, "
                        "tensor, pipeline and expert parallelism so far (context parallelism and expertTensor > 1 "
                        "are not launched yet): set them to 1 and spread the GPUs over parallelism.tensor, "
                        "parallelism.pipeline, parallelism.expert and parallelism.data")
    return problems


# where config.json says how many experts a MoE layer has: Qwen3-MoE as published (`num_experts`), as transformers 5
# saves it and Mixtral (`num_local_experts`), DeepSeek (`n_routed_experts`), ERNIE (`moe_num_experts`)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def config_experts(hf_config: Mapping[str, Any] | None) -> int | None:
    """Experts per MoE layer in an HF config.json (a VL model's in its text_config; 0: dense), None: not read."""
    if not hf_config:
        return None
    for section in (hf_config, hf_config.get("text_config") or {}):
        for key in EXPERT_KEYS:
            if isinstance(section.get(key), int) and section[key] > 0:
                return int(section[key])
    return 0


def planned_backend(cfg: TrainerConfig, hf_config: Mapping[str, Any] | None, gpus: bool) -> Backend:
    """The backend a job planned on nodes with (`gpus`) or without GPUs would get (backends/select.resolve_backend):
    `auto` keeps a CPU job, a VL model, or a model type megatron does not map, on torch; a model not readable here
    is taken as one megatron maps (its size threshold is left out: a job planned for GPUs is taken as large)."""
    if cfg.backend is not Backend.AUTO:
        return cfg.backend
    if not gpus:
        return Backend.TORCH
    hf = hf_config or {}
    return Backend.MEGATRON if megatron_maps(hf.get("model_type"), bool(hf.get("vision_config"))) else Backend.TORCH


def planned_start_problems(cfg: TrainerConfig, hf_config: Mapping[str, Any] | None, gpus: bool) -> list[str]:
    """What the trainer would refuse at start, on the backend it would pick (`planned_backend`)."""
    backend = planned_backend(cfg, hf_config, gpus)
    layers = (hf_config or {}).get("num_hidden_layers")
    return [f"backend {backend}: {line}"
            for line in actor_layout_problems(cfg, backend, layers, config_experts(hf_config))]
