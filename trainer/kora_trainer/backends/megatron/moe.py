"""Qwen3-MoE on megatron-core: the MoE part of the TransformerConfig, the per-layer spec (local spec, megatron's
SequentialMLP experts), and the fused <-> per-expert HF expert tensors. megatron-core is imported lazily.

HF Qwen3-MoE (transformers 5, `Qwen3MoeSparseMoeBlock`) routes each token as
    p = softmax(x·Wgᵀ) over all E experts (fp32);  top-k of p;  if norm_topk_prob: p_topk /= Σ p_topk
and sums p_e · down_e(silu(gate_e x) * up_e x) over the k experts chosen; no shared expert, no bias.
megatron's TopKRouter (`topk_routing_with_score_function`, score function softmax) gives the same:
- norm_topk_prob = True  -> `moe_router_pre_softmax=False`: top-k of the logits, softmax over those k.
  softmax is monotone, so the experts chosen are HF's, and exp(l_i)/Σ_topk exp(l_j) = p_i/Σ_topk p_j.
- norm_topk_prob = False -> `moe_router_pre_softmax=True`: softmax over all E, top-k, no renormalisation.
No load-balancing term touches the forward (`moe_router_load_balancing_type="none"`, aux / z-loss off, no
input jitter), no token is dropped (`moe_expert_capacity_factor=None`), no expert bias, no score scaling.
The router computes in the activation dtype (`moe_router_dtype=None`), as HF's `F.linear` does.

Experts: `SequentialMLP` of megatron `MLP`s (ColumnParallelLinear / RowParallelLinear) — the only experts
module the local (non-TransformerEngine) spec builds; GroupedMLP needs TE's grouped GEMM. Each expert's
`linear_fc1` is [gate_e; up_e] (megatron's GLU: `chunk(2)`, silu on the first half — the same order as HF's
fused `gate_up_proj[e]` rows), `linear_fc2` is down_e. Dense layers (`mlp_only_layers`,
`decoder_sparse_step`) keep the dense MLP with `intermediate_size`; megatron's `moe_layer_freq` gets HF's
pattern as an explicit list (its integer form counts from layer 0, HF's from layer 1).

Expert LoRA: `apply_lora` with linear_fc1 / linear_fc2 wraps every expert's linears too (one
(A, B) per expert; megatron's expert linears are plain Column/RowParallelLinear there). Exported in PEFT's
grouped `target_parameters` layout on `mlp.experts.{gate_up_proj,down_proj}` (transformers 5's fused
[E, out, in] expert tensors; peft's ParamWrapper): lora_A [E·r, in] = the experts' A stacked (rows
expert-major), lora_B [out, r·E] with column j·E + e = column j of expert e's B (rank-major). Expert e's
gate_up update is B_e·A_e on its [gate_e; up_e] rows: one A per expert is exact because HF fuses gate and up
too. Merge mode needs nothing new (`hf_state(merged=True)` folds each expert's wrapper). `export.py`
(`hf_adapter_tensors`, `load_hf_adapter`, `peft_config`) calls the functions below for the experts; the
router's LoRA (lora.LoRARouter) is a plain [r, H] / [E, r] pair named by convert.py (`mlp.gate`).

Parallelism: expert parallelism splits each MoE layer's experts over the EP ranks (each rank's own LoRA
factors; `expert_factors` gathers them). The experts are never split by tensor parallelism (expertTensor 1);
at tensor > 1 megatron trains MoE layers only under sequence parallelism, which kora turns on for every model at
tensor > 1 (model.transformer_config): between the layers each TP rank holds 1/tp of the tokens (sequences padded
to a multiple of tp), the dispatcher sends a rank's own tokens to the experts, the frozen norms work on the shard
(model.FrozenTokenNorm), and the LoRA factors that see only a rank's tokens are summed over the TP group (lora.py).

Not yet: expertTensor > 1 (refused at start), shared experts (Qwen2-MoE), GroupedMLP.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch

from kora_trainer.backends.megatron import parallel  # called as parallel.X(): tests put a fake rank layout there
from kora_trainer.backends.megatron.convert import PEFT_PREFIX, Layout, moe_layer_indices
from kora_trainer.backends.megatron.lora import lora_modules
from kora_trainer.backends.megatron.numbering import numbering
from kora_trainer.backends.megatron.parallel import gather_experts
from kora_trainer.lora.grouped import group_expert_factors, split_expert_factors

MOE_MODEL_TYPES = ("qwen3_moe",)
DISPATCHERS = ("alltoall", "allgather")



def is_moe_config(cfg: Any) -> bool:
    return getattr(cfg, "model_type", "") in MOE_MODEL_TYPES and bool(moe_layer_indices(cfg))


def check_moe_supported(cfg: Any) -> None:
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        raise NotImplementedError("shared experts (Qwen2-MoE style) are not mapped onto megatron yet")
    k, e = int(cfg.num_experts_per_tok), int(cfg.num_experts)
    if not 0 < k <= e:
        raise ValueError(f"num_experts_per_tok {k} with {e} experts")
    if k == 1 and getattr(cfg, "norm_topk_prob", False):
        # HF's weight is then exactly 1; megatron refuses a post-top-k softmax over one expert
        raise NotImplementedError("num_experts_per_tok = 1 with norm_topk_prob is not mapped onto megatron")


def moe_config_kwargs(cfg: Any, dispatcher: str = "alltoall", expert: int = 1) -> dict[str, Any]:
    """The TransformerConfig fields of an HF Qwen3-MoE config (an empty dict for a dense config); `expert`: the
    expert-parallel size (each rank holds num_experts / expert of every MoE layer's experts). The experts are
    never split by tensor parallelism (expert_tensor_parallel_size 1: SPEC rule 6, expert LoRA folds on the rank
    that holds the expert); at tensor > 1 the attention is, under sequence parallelism (model.transformer_config)."""
    if not is_moe_config(cfg):
        return {}
    check_moe_supported(cfg)
    if int(cfg.num_experts) % expert:
        raise ValueError(f"parallelism.expert {expert} does not divide the model's {cfg.num_experts} experts: set "
                         "parallelism.expert to a divisor of num_experts")
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"moe dispatcher {dispatcher!r}: one of {DISPATCHERS}")
    moe = set(moe_layer_indices(cfg))
    return dict(
        num_moe_experts=int(cfg.num_experts), moe_router_topk=int(cfg.num_experts_per_tok),
        moe_ffn_hidden_size=int(cfg.moe_intermediate_size),
        moe_layer_freq=[1 if i in moe else 0 for i in range(cfg.num_hidden_layers)],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(getattr(cfg, "norm_topk_prob", False)),
        moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False,
        moe_router_num_groups=None, moe_router_group_topk=None, moe_router_dtype=None,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
        moe_input_jitter_eps=None, moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
        moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_router_fusion=False, moe_shared_expert_intermediate_size=None,
        expert_model_parallel_size=expert, expert_tensor_parallel_size=1,
    )


def moe_layer_spec(config: Any) -> Any:
    """The local spec's layer with `num_experts` (SequentialMLP experts, TopKRouter): what model.block_spec builds
    where `moe_layer_freq` is 1 (the dense local layer where it is 0)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    return get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_layernorm, normalization="RMSNorm")


# ---- expert LoRA in PEFT's grouped layout ----------------------------------------------------------------

# megatron expert linear -> transformers-5 fused expert parameter; PEFT target_parameters order (the LAST one is
# PEFT's outer ParamWrapper on `mlp.experts`, each earlier one one `.base_layer` deeper)
EXPERT_PARAMS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
_EXPERT = ".mlp.experts.local_experts."


def is_expert_module(name: str) -> bool:
    """A megatron module path inside an MoE layer's experts (its LoRA is exported grouped, by this module)."""
    return _EXPERT in name


def expert_lora_groups(model: torch.nn.Module, layout: Layout) -> dict[tuple[int, str], list[Any | None]]:
    """(MoE layer, fused HF parameter) -> the E expert LoRA wrappers in expert order: this rank's own, None where
    another expert-parallel rank holds the expert."""
    mods = lora_modules(model)
    owns = numbering(model).owns_expert
    out: dict[tuple[int, str], list[Any | None]] = {}
    for i in layout.moe_layers:
        for leaf, param in EXPERT_PARAMS.items():
            ms = [mods.get(f"decoder.layers.{i}{_EXPERT}{e}.{leaf}") for e in range(layout.num_experts)]
            if all(m is None for m in ms):
                continue
            loras = [m for m in ms if m is not None]
            mine = [e for e in range(layout.num_experts) if owns(e)]
            if [e for e, m in enumerate(ms) if m is not None] != mine or len({(m.rank, m.scaling) for m in loras}) != 1:
                raise ValueError(f"layer {i} {leaf}: every expert needs a LoRA of the same rank and alpha")
            if any(m.tp_size != 1 for m in loras):
                raise NotImplementedError("expert LoRA under tensor parallelism is not wired yet")
            out[(i, param)] = ms
    return out


def expert_factors(model: torch.nn.Module, layout: Layout) -> dict[tuple[int, str], list[tuple[torch.Tensor,
                                                                                             torch.Tensor]]]:
    """(MoE layer, fused HF parameter) -> every expert's (A, B), in expert order: under expert parallelism each
    rank's own, gathered over the expert-parallel group (a collective of it; on this rank's device)."""
    groups = expert_lora_groups(model, layout)
    own = {(key, e): (m.lora_A.weight.detach(), m.lora_B.weight.detach())
           for key, ms in groups.items() for e, m in enumerate(ms) if m is not None}
    if parallel.ep_rank_size()[1] > 1:
        device = next(model.parameters()).device
        for part in gather_experts({k: (a.cpu(), b.cpu()) for k, (a, b) in own.items()}):
            own.update({k: (a.to(device), b.to(device)) for k, (a, b) in cast(dict[Any, Any], part).items()
                        if k not in own})
    return {key: [own[(key, e)] for e in range(len(ms))] for key, ms in groups.items()}


def expert_target_parameters(wrapped: Iterable[str]) -> list[str]:
    """PEFT `target_parameters` for the adapted experts, from the LoRA module paths `wrapped` (e.g.
    ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]; [] for a model without expert LoRA)."""
    leaves = {n.rsplit(".", 1)[-1] for n in wrapped if is_expert_module(n)}
    return [f"mlp.experts.{p}" for leaf, p in EXPERT_PARAMS.items() if leaf in leaves]


def peft_expert_key(layer: int, param: str, which: str, params: list[str]) -> str:
    """The HF-PEFT tensor name of a grouped expert factor (`params`: the experts' target_parameters, in order)."""
    depth = len(params) - 1 - params.index(f"mlp.experts.{param}")
    return f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts{'.base_layer' * depth}.lora_{which}.weight"


def _grouped_params(groups: Mapping[tuple[int, str], Any]) -> list[str]:
    present = {param for _, param in groups}
    return [f"mlp.experts.{p}" for p in EXPERT_PARAMS.values() if p in present]


def expert_adapter_tensors(model: torch.nn.Module, layout: Layout) -> dict[str, torch.Tensor]:
    """The experts' LoRA factors under PEFT's grouped names ({} without expert LoRA; every expert-parallel rank's
    experts, a collective of the EP group). TP = 1."""
    groups = expert_factors(model, layout)
    params = _grouped_params(groups)
    out: dict[str, torch.Tensor] = {}
    for (i, param), factors in groups.items():
        a, b = group_expert_factors([f[0] for f in factors], [f[1] for f in factors])
        out[peft_expert_key(i, param, "A", params)], out[peft_expert_key(i, param, "B", params)] = a, b
    return out


def load_expert_adapter(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], layout: Layout) -> set[str]:
    """Set every expert wrapper's A and B from PEFT's grouped tensors; returns the names it used."""
    groups = expert_lora_groups(model, layout)
    params = _grouped_params(groups)
    used: set[str] = set()
    for (i, param), ms in groups.items():
        ka, kb = peft_expert_key(i, param, "A", params), peft_expert_key(i, param, "B", params)
        for m, (a, b) in zip(ms, split_expert_factors(tensors[ka], tensors[kb], len(ms)), strict=True):
            if m is not None:  # this rank's own experts (expert parallelism: the others' are theirs to load)
                m.load_factors(a, b)
        used.update((ka, kb))
    return used
