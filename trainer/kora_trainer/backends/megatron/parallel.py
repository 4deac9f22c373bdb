"""torch.distributed + megatron parallel_state set-up, and the tensor-parallel gather the exports use.

One process per GPU. Started by torchrun (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* in the environment) or
alone: then a real process group of size 1 on 127.0.0.1 — megatron's layers always talk through a group.

Pipeline stages: megatron's parallel_state orders the world tensor-first, so the ranks of one stage's TP group are
adjacent and a rank's pipeline group holds its counterparts on the other stages. Only the last stage computes
log-probs; `from_last_stage` hands them to the other stages so every rank returns the same numbers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kora_trainer.wire.ports import free_port


def init_parallel(tensor: int = 1, seed: int = 0, backend: str | None = None, pipeline: int = 1,
                  expert: int = 1) -> None:
    """Join (or create) the default process group (NCCL with a GPU, else gloo), then initialise megatron's
    model-parallel groups and RNG."""
    from megatron.core import parallel_state, tensor_parallel  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", str(rank))))
        dist.init_process_group(backend, rank=rank, world_size=world)
    if not parallel_state.model_parallel_is_initialized():
        # experts: carved out of the data-parallel ranks (megatron's expert_model_parallel_size), never split by TP
        # (expert_tensor_parallel_size 1, as the TransformerConfig says: moe.moe_config_kwargs)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor,
                                                 pipeline_model_parallel_size=pipeline,
                                                 expert_model_parallel_size=expert,
                                                 expert_tensor_parallel_size=1)
    elif (got := (parallel_state.get_tensor_model_parallel_world_size(),
                  parallel_state.get_pipeline_model_parallel_world_size(),
                  parallel_state.get_expert_model_parallel_world_size())) != (tensor, pipeline, expert):
        raise RuntimeError(f"megatron is already initialised with tensor x pipeline x expert parallel size "
                           f"{' x '.join(map(str, got))}, not {tensor} x {pipeline} x {expert}")
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def gather_tp(t: torch.Tensor) -> list[torch.Tensor]:
    """Every TP rank's copy of a sharded tensor, in rank order (the local tensor alone when TP = 1)."""
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return out


def pp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size())


def is_last_stage() -> bool:
    rank, size = pp_rank_size()
    return rank == size - 1


def from_last_stage(t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """The last pipeline stage's tensor `t` on every stage (`t` is ignored elsewhere; `shape` and `dtype` say
    what arrives). One broadcast over this rank's pipeline group."""
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    rank, size = pp_rank_size()
    if size == 1:
        assert t is not None
        return t
    out = t.contiguous() if rank == size - 1 and t is not None else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(out, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return out


def _gather_objects(obj: object, size: int, group: Callable[[], Any]) -> list[object]:
    """Every member's `obj` of the group `group()` (of `size` members), in member order; [obj] for a group of one.
    Pickled: for small or CPU-side things (names, tensors moved to the CPU)."""
    if size == 1:
        return [obj]
    parts: list[object] = [None] * size
    dist.all_gather_object(parts, obj, group=group())
    return parts


def gather_stages(obj: object) -> list[object]:
    """Every pipeline stage's `obj`, in stage order, on every stage ([obj] with one stage)."""
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    return _gather_objects(obj, pp_rank_size()[1], parallel_state.get_pipeline_model_parallel_group)


def ep_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    return (parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size())


def gather_experts(obj: object) -> list[object]:
    """Every expert-parallel rank's `obj`, in EP rank order ([obj] without expert parallelism)."""
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    return _gather_objects(obj, ep_rank_size()[1], parallel_state.get_expert_model_parallel_group)
