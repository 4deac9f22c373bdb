"""LoRA for megatron-core's tensor-parallel linears: y = W x + (alpha/r) · B A dropout(x)  (Hu et al. 2021,
https://arxiv.org/abs/2106.09685). The base stays frozen; only A and B train.

Which factor is sharded under tensor parallelism (TP, no sequence parallelism):

- ColumnParallelLinear (linear_qkv, linear_fc1): W is split on its OUTPUT rows, W_t [out/tp, in], and every
  rank sees the whole input x. B [out, r] is split like W (B_t [out/tp, r], same row layout — the fused
  QKV / [gate_t; up_t] order, see convert.py), A [r, in] is replicated. Then y_t = W_t x + s·B_t (A x) is
  exactly rank t's slice of the full LoRA output, with no collective in the forward. In the backward each
  rank holds only a part of dL/d(Ax) = Σ_t B_tᵀ g_t, so `A x` passes through megatron's
  `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward): the sum is formed once and
  A's gradient is identical on every rank, as a replicated parameter's must be. Sharding A instead would
  need an all-gather of A x in every forward.
- RowParallelLinear (linear_proj, linear_fc2): W is split on its INPUT columns, W_t [out, in/tp], and rank t
  sees only its slice x_t (`input_is_parallel`). A [r, in] is split like W (A_t [r, in/tp]) so it consumes
  x_t; the partial products A_t x_t are all-reduced (`reduce_from_tensor_model_parallel_region`: all-reduce
  forward, identity backward) — r numbers per token, tiny next to the base's own all-reduce of [tokens, out]
  — and B [out, r] is replicated, producing the full output every rank already holds after the base's
  reduction. Sharding B instead would leave a partial output needing a second full-width reduction.

So only the factor on W's sharded side is sharded, and LoRA adds at most one r-wide collective per layer.

Under sequence parallelism (every model at TP > 1: model.py) a column wrapper's input is this rank's share of the
tokens [s/tp, b, in]: A x is all-gathered over the sequence (`gather_from_sequence_parallel_region`; backward:
the Σ_t B_tᵀ g_t sum reduce-scattered, each rank its own tokens), and a row wrapper's A_t x_t is reduce-scattered
to the rank's tokens (`reduce_scatter_to_sequence_parallel_region`) as the base's output is. The replicated
factor (column A, row B; the router's A and B) then sees only the rank's tokens, so its gradient is partial: it
is marked `sequence_parallel` and the backend sums it over the TP group (backends/data_parallel.py). Every
collective runs on the wrapped layer's own TP group (an expert's is of size 1: expertTensor 1).

Dropout: on the replicated input of a column wrapper the mask must be the same on every TP rank (default
RNG, seeded alike across TP by megatron); on the sharded input of a row wrapper it uses megatron's
model-parallel RNG (different per rank), as megatron does for its own dropout in TP regions.

Init (PEFT's): A ~ kaiming-uniform(a=√5) = U(±1/√in), B = 0, so training starts from the base policy.
A is drawn at full size, then sliced, from a CPU generator per wrapped module seeded with (seed, the module's
GLOBAL name: model.py `global_name`): the same seed gives the same adapter whatever the TP, pipeline and expert
sizes (a later stage, or an expert-parallel rank, draws its own modules' A without replaying the others' draws).

Router (`router`, Qwen3-MoE; SPEC rule 5: Adapter mode only): megatron's TopKRouter keeps its gate as a bare
[E, H] parameter and computes the logits in `gating(input)` (megatron-core 0.19.2: `Router.gating`, called by
`TopKRouter.forward` after the input jitter, before top-k). `LoRARouter` replaces the router in the MoE layer
(parameters `…mlp.router.base_layer.weight`, `…mlp.router.lora_{A,B}.weight`, like the linear wrappers) and
shadows that router's `gating`: logits = x·Wgᵀ + s·(dropout(x)·Aᵀ)·Bᵀ, A [r, H], B [E, r], both replicated;
routing (softmax, top-k) then sees the adapted logits. At TP > 1 only under sequence parallelism (above).

megatron is imported lazily: this module imports on machines without megatron-core.
"""

from __future__ import annotations

import math
import zlib
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kora_trainer.backends.megatron.numbering import global_name, numbering
from kora_trainer.backends.megatron.parallel import gather_experts, gather_stages
from kora_trainer.config import LoRASpec, SyncMode, TargetModule
from kora_trainer.kernels.fold import fold
from kora_trainer.lora import model as hf_lora
from kora_trainer.lora.params import DelegatesToBase

SUPPORTED = {TargetModule.LINEAR_QKV: "linear_qkv", TargetModule.LINEAR_PROJ: "linear_proj",
             TargetModule.LINEAR_FC1: "linear_fc1", TargetModule.LINEAR_FC2: "linear_fc2",
             TargetModule.ROUTER: "router"}


def _tp(base: nn.Module) -> tuple[int, int]:
    group = getattr(base, "tp_group", None)
    if group is None:
        return 0, 1
    return group.rank(), group.size()


class MegatronLoRA(nn.Module):
    """What every megatron LoRA wrapper holds, under PEFT's names: the frozen `base_layer` (its `.weight`
    [out, in] is this TP rank's shard), `lora_A` [r, in] / `lora_B` [out, r] shaped like that weight,
    `scaling` = alpha / r, `dropout`, `enabled`. The module walks below (`lora_modules`, `adapter_parameters`,
    `adapter_disabled`, ...) take this class. `a_local`: this rank's part of A's PEFT init; B starts at 0."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float, a_local: torch.Tensor):
        super().__init__()
        self.base_layer = base
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.tp_rank, self.tp_size = _tp(base)
        w = base.get_parameter("weight")
        kw = {"device": w.device, "dtype": w.dtype}
        self.lora_A = nn.Linear(w.shape[1], rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, w.shape[0], bias=False, **kw)
        self.load_factors(a_local, torch.zeros_like(self.lora_B.weight))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True

    # the attention / MLP modules and megatron utilities look at these on the module they hold
    # (nn.Module's __getattr__ types an attribute as Tensor | Module: the megatron layer's are tensors)
    @property
    def weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.base_layer.weight)

    @property
    def bias(self) -> torch.Tensor | None:
        return cast("torch.Tensor | None", self.base_layer.bias)

    @torch.no_grad()
    def load_factors(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Set A and B (this rank's shards) from tensors on any device / dtype."""
        self.lora_A.weight.copy_(a.to(self.lora_A.weight.device, self.lora_A.weight.dtype))
        self.lora_B.weight.copy_(b.to(self.lora_B.weight.device, self.lora_B.weight.dtype))

    @torch.no_grad()
    def folded_weight(self) -> torch.Tensor:
        """This rank's shard of W + (alpha/r)·B·A (fp32, rounded once): the shard of the full fold."""
        return fold(cast(torch.Tensor, self.base_layer.weight), self.lora_A.weight, self.lora_B.weight, self.scaling)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, tp={self.tp_rank}/{self.tp_size}, enabled={self.enabled}"


class _ParallelLoRA(MegatronLoRA):
    """The two tensor-parallel linear wrappers: which factor is sharded follows the base (module docstring)."""

    column: bool

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float, a_full: torch.Tensor,
                 gated: bool = False):
        if getattr(base, "explicit_expert_comm", False) and _tp(base)[1] > 1:
            # an expert linear whose own TP group splits it (expertTensor > 1); one per expert-parallel rank is fine
            raise NotImplementedError("LoRA on MoE experts split by tensor parallelism (expertTensor > 1) is not "
                                      "wired yet")
        tp_rank, tp_size = _tp(base)
        # column: A replicated [r, in], B sharded like W [out/tp, r]; row: A sharded like W [r, in/tp], B replicated
        super().__init__(base, rank, alpha, dropout, a_full if self.column else a_full.chunk(tp_size, dim=1)[tp_rank])
        from megatron.core import tensor_parallel  # noqa: PLC0415 - megatron-core is optional: this module imports without it

        sharded, dim = (self.lora_B.weight, 0) if self.column else (self.lora_A.weight, 1)
        if self.tp_size > 1:  # so megatron's grad-norm and checkpointing treat it as a shard; a gated linear_fc1's
            # B shard is [gate_t; up_t] (stride 2: backends/megatron/tp_checkpoint.py joins it so)
            tensor_parallel.set_tensor_model_parallel_attributes(sharded, is_parallel=True, dim=dim,
                                                                 stride=2 if gated and self.column else 1)
        # sequence parallelism (module docstring): the replicated factor sees this rank's tokens only
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and self.tp_size > 1
        if self.sequence_parallel:
            replicated = self.lora_A.weight if self.column else self.lora_B.weight
            replicated.sequence_parallel = True  # type: ignore[attr-defined]

    def backward_dw(self) -> None:
        cast(Any, self.base_layer).backward_dw()  # megatron's TE linear layers (untyped here)


class LoRAColumnParallelLinear(_ParallelLoRA):
    column = True

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, bias = self.base_layer(x, *args, **kwargs)  # x [s, b, in] -> out [s, b, out/tp] (or gathered)
        if not self.enabled:
            return out, bias
        from megatron.core import tensor_parallel  # noqa: PLC0415 - megatron-core is optional: this module imports without it

        a = F.linear(self.dropout(x.to(self.lora_A.weight.dtype)), self.lora_A.weight)  # [s, b, r]
        group = self.base_layer.tp_group
        if self.sequence_parallel:  # [s/tp, b, r] -> [s, b, r]; backward: Σ over TP, each rank its own tokens
            a = tensor_parallel.gather_from_sequence_parallel_region(a, True, group)
        elif self.tp_size > 1:  # backward: Σ over TP of the B_tᵀ g_t parts
            a = tensor_parallel.copy_to_tensor_model_parallel_region(a, group)
        delta = F.linear(a, self.lora_B.weight) * self.scaling  # [s, b, out/tp]
        gather = kwargs.get("runtime_gather_output")
        if gather is None:
            gather = self.base_layer.gather_output
        if gather and self.tp_size > 1:
            delta = tensor_parallel.gather_from_tensor_model_parallel_region(delta)
        return out + delta.to(out.dtype), bias


class LoRARowParallelLinear(_ParallelLoRA):
    column = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.base_layer.input_is_parallel:
            raise NotImplementedError("LoRA on a RowParallelLinear whose input is not already split")
        out, bias = self.base_layer(x)  # x [s, b, in/tp] -> out [s, b, out] (reduced over TP)
        if not self.enabled:
            return out, bias
        from megatron.core import tensor_parallel  # noqa: PLC0415 - megatron-core is optional: this module imports without it

        x = x.to(self.lora_A.weight.dtype)
        if isinstance(self.dropout, nn.Dropout) and self.tp_size > 1:
            with tensor_parallel.get_cuda_rng_tracker().fork():  # each rank drops its own input slice
                x = self.dropout(x)
        else:
            x = self.dropout(x)
        a = F.linear(x, self.lora_A.weight)  # [s, b, r] partial: this rank's slice of the input
        group = self.base_layer.tp_group
        if self.sequence_parallel:  # Σ over TP, each rank keeping its own tokens [s/tp, b, r], as the base's output
            a = tensor_parallel.reduce_scatter_to_sequence_parallel_region(a, group)
        elif self.tp_size > 1:  # Σ over TP -> A x, the same on all ranks
            a = tensor_parallel.reduce_from_tensor_model_parallel_region(a, group)
        delta = F.linear(a, self.lora_B.weight) * self.scaling  # [s, b, out] ([s/tp, b, out])
        return out + delta.to(out.dtype), bias


class LoRARouter(MegatronLoRA, DelegatesToBase):
    """LoRA on an MoE router's logits: x·Wgᵀ + s·(dropout(x)·Aᵀ)·Bᵀ, A [r, H], B [E, r] (module docstring).
    Takes the router's place in its MoE layer; the router itself runs unchanged but for its `gating`; anything
    else megatron reads off `mlp.router` (topk, config, expert_bias, ...) is the router's."""

    def __init__(self, base: Any, rank: int, alpha: float, dropout: float, a_full: torch.Tensor):
        sequence_parallel = bool(getattr(base.weight, "sequence_parallel", False))
        if _tp(base)[1] != 1 and not sequence_parallel:
            raise NotImplementedError("router LoRA under tensor parallelism without sequence parallelism: the "
                                      "megatron backend turns sequence parallelism on for MoE models at tensor > 1")
        super().__init__(base, rank, alpha, dropout, a_full)
        if sequence_parallel:  # the router sees this rank's tokens only: both factors' gradients are partial
            for p in (self.lora_A.weight, self.lora_B.weight):
                p.sequence_parallel = True  # type: ignore[attr-defined]
        # this router instance only (TopKRouter.forward calls self.gating); a bound method, so a deepcopy of the
        # model rebinds it to the copy's wrapper
        base.gating = self._gating

    def _gating(self, x: torch.Tensor) -> torch.Tensor:  # x [s, b, H] -> logits [s, b, E]
        router: Any = self.base_layer
        logits: torch.Tensor = type(router).gating(router, x)  # megatron's Router.gating
        if not self.enabled:
            return logits
        a = F.linear(self.dropout(x.to(self.lora_A.weight.dtype)), self.lora_A.weight)  # [s, b, r]
        return logits + (F.linear(a, self.lora_B.weight) * self.scaling).to(logits.dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.base_layer(*args, **kwargs)  # (probs, routing_map)

    def set_layer_number(self, layer_number: int) -> None:  # MoELayer.set_layer_number calls it on its router
        router: Any = self.base_layer
        router.set_layer_number(layer_number)


def apply_lora(model: nn.Module, spec: LoRASpec, seed: int = 0) -> list[str]:
    """Wrap the targeted megatron linears (and MoE routers) in place; freeze everything but the adapters.
    Returns module names.

    Supported targets: linear_qkv, linear_proj, linear_fc1, linear_fc2 (dense layers, and every MoE expert's
    linears at TP = 1), router (MoE routers, TP = 1; SPEC rule 5: lora.syncMode Adapter). GDN projections
    raise here rather than train nothing, as does a target that matches no module of this model.
    """
    unsupported = [str(t) for t in spec.target_modules if TargetModule(t) not in SUPPORTED]
    if unsupported:
        raise NotImplementedError(f"lora.targetModules {unsupported}: not yet supported by the megatron backend")
    if TargetModule.ROUTER in spec.target_modules and spec.effective_sync_mode is not SyncMode.ADAPTER:
        raise ValueError("lora.targetModules contains router, which requires lora.syncMode Adapter (SPEC rule 5: "
                         "Merge and EngineMerge fold plain linear layers only)")

    leaves = {SUPPORTED[TargetModule(t)] for t in spec.target_modules}
    numbers = numbering(model)
    model.requires_grad_(False)
    names: list[str] = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in leaves:
            continue
        gen = torch.Generator().manual_seed(module_seed(seed, global_name(name, numbers)))
        gated = leaf == "linear_fc1" and bool(getattr(getattr(module, "config", None), "gated_linear_unit", False))
        wrapper = _wrap(module, spec, gen, gated)
        if wrapper is None:
            continue
        wrapper.train(module.training)
        parent_name, _, _ = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, wrapper)
        names.append(global_name(name, numbers))
    unmatched = sorted(leaves - {n.rsplit(".", 1)[-1] for n in names})
    if unmatched:
        raise ValueError(f"lora.targetModules {unmatched} matched no module of this megatron model (router needs an "
                         "MoE model); remove them from lora.targetModules")
    for p in adapter_parameters(model):
        p.requires_grad_(True)
    return names


def module_seed(seed: int, name: str) -> int:
    """The LoRA init seed of one wrapped module (its global name): distinct per module, the same on every rank."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _wrap(module: nn.Module, spec: LoRASpec, gen: torch.Generator, gated: bool = False) -> MegatronLoRA | None:
    """The LoRA wrapper for one megatron module (None: not a kind LoRA wraps), A drawn at full size; `gated`: a
    gated MLP's linear_fc1 ([gate; up] rows)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: PLC0415 - megatron-core is optional: this module imports without it
    from megatron.core.transformer.moe.router import TopKRouter  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    cls: type[MegatronLoRA]
    if isinstance(module, TopKRouter):
        cls, in_full = LoRARouter, module.weight.shape[1]
    elif isinstance(module, ColumnParallelLinear):
        cls, in_full = LoRAColumnParallelLinear, module.weight.shape[1]
    elif isinstance(module, RowParallelLinear):
        cls, in_full = LoRARowParallelLinear, module.weight.shape[1] * _tp(module)[1]
    else:
        return None
    bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=√5) on [r, in]
    a_full = torch.empty(spec.rank, in_full).uniform_(-bound, bound, generator=gen)
    if cls is LoRAColumnParallelLinear:
        return LoRAColumnParallelLinear(module, spec.rank, spec.alpha, spec.dropout, a_full, gated)
    return cls(module, spec.rank, spec.alpha, spec.dropout, a_full)


def lora_modules(model: nn.Module) -> dict[str, MegatronLoRA]:
    """This stage's LoRA wrappers by GLOBAL module name (`decoder.layers.{global index}.…`), in model order."""
    numbers = numbering(model)
    return {global_name(name, numbers): m for name, m in hf_lora.lora_modules(model, MegatronLoRA).items()}


def all_lora_modules(model: nn.Module) -> list[str]:
    """Every LoRA module name of the whole model: this rank's, then the other expert-parallel ranks' experts, then
    the other pipeline stages' (each once; a collective of those groups)."""
    names = list(lora_modules(model))
    for gather in (gather_experts, gather_stages):
        names = list(dict.fromkeys(n for part in gather(names) for n in cast(list[str], part)))
    return names


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    return hf_lora.adapter_parameters(model, MegatronLoRA)


def check_only_adapters_trainable(model: nn.Module) -> None:
    hf_lora.check_only_adapters_trainable(model, MegatronLoRA)


def adapter_disabled(model: nn.Module) -> AbstractContextManager[None]:
    """The base policy (GRPO's KL reference) from the same weights."""
    return hf_lora.adapter_disabled(model, MegatronLoRA)
