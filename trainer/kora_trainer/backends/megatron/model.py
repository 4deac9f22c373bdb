"""A megatron-core GPTModel built from an HF config (Qwen3, Qwen3-MoE) with the local layer spec, and HF weights in it.

Local spec (`get_gpt_layer_local_spec`): ColumnParallelLinear / RowParallelLinear, torch RMSNorm,
DotProductAttention — no TransformerEngine, no Apex. Qwen3 maps onto it as: RMSNorm everywhere
(eps = rms_norm_eps), per-head RMSNorm on q and k before RoPE (`qk_layernorm`), GQA (`num_query_groups`),
SwiGLU (`gated_linear_unit` + silu), no linear biases (`attention_bias` adds the qkv bias), non-interleaved
RoPE over the full head dim with base `rope_theta`, embeddings tied or not (`tie_word_embeddings`).

Numerics that differ from HF and why logits still agree: megatron's fallback softmax runs in fp32 when
`attention_softmax_in_fp32`; RoPE's cos/sin are cast to the activation dtype before use in both; HF's
RMSNorm computes in fp32 and rounds once, torch.nn.RMSNorm in bf16 accumulates in fp32 too. The GPU tests
state the tolerances measured.

Pipeline stages: each stage builds its share of the layers (megatron numbers them locally, `decoder.layers.0` on
every stage, and keeps the global number in `layer_number`), the embedding on the first stage, the final norm and
the output layer on the last. Everything kora names a parameter by (the HF maps, the adapter's names, checkpoints,
sync) takes the GLOBAL layer index (`base_parameters`, `global_name`), so a stage's tensors are named as the
one-stage model names them.

Tensor parallelism > 1 runs with sequence parallelism, dense models and MoE alike (megatron's layout; MoE layers
train at tensor > 1 only so): between the layers each TP rank holds 1/tp of the tokens (the embedding's output is
reduce-scattered, each linear_qkv / linear_fc1 all-gathers its input, each linear_proj / linear_fc2
reduce-scatters its output), so the activations kept for the backward shrink by the TP size. Sequences are padded
to a multiple of tp (pipeline.sequence_multiple); the frozen norms work on the shard (`FrozenTokenNorm`); LoRA
takes the same gathers and reduce-scatters (lora.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kora_trainer.backends.megatron.convert import (
    REPL,
    Layout,
    from_megatron_shards,
    layout_from_hf_config,
    param_maps,
    to_megatron_shard,
)
from kora_trainer.backends.megatron.lora import lora_modules
from kora_trainer.backends.megatron.moe import is_expert_module, moe_config_kwargs, moe_layer_spec
from kora_trainer.backends.megatron.numbering import LOCAL_EXPERT, global_name, numbering
from kora_trainer.backends.megatron.parallel import ep_rank_size, gather_tp, pp_rank_size, tp_rank_size
from kora_trainer.config.start_layout import MEGATRON_MODEL_TYPES
from kora_trainer.hf_experts import unfuse_hf_experts
from kora_trainer.kernels.fold import fold


def rope_theta(cfg: Any) -> float:
    """RoPE base from an HF config: transformers 5 keeps it in `rope_parameters`, 4.x in `rope_theta`."""
    params = getattr(cfg, "rope_parameters", None) or {}
    scaling = getattr(cfg, "rope_scaling", None) or {}
    kind = (params.get("rope_type") if isinstance(params, dict) else None) or scaling.get("rope_type") or "default"
    if kind != "default":
        raise NotImplementedError(f"rope_type {kind!r}: only plain RoPE is mapped onto megatron so far")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


def check_supported(cfg: Any) -> None:
    model_type = getattr(cfg, "model_type", "")
    if model_type not in MEGATRON_MODEL_TYPES:
        raise NotImplementedError(f"model_type {model_type!r}: the megatron backend maps Qwen3 dense (and its "
                                  "Llama-family relatives) and Qwen3-MoE so far")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {cfg.hidden_act!r}: only SwiGLU is mapped")


def transformer_config(cfg: Any, dtype: torch.dtype = torch.bfloat16, tensor: int = 1, init: bool = False,
                       moe_dispatcher: str = "alltoall", pipeline: int = 1, expert: int = 1) -> Any:
    """megatron TransformerConfig for an HF Qwen3 (or Qwen3-MoE: moe.py) config. `init`: megatron initialises
    the weights (random models for benchmarks); otherwise they stay uninitialised until `load_hf_state`.
    `moe_dispatcher`: megatron's token dispatcher for MoE layers ("alltoall" or "allgather").
    `pipeline` stages: micro-batches of any length pass between them (`variable_seq_lengths`: GRPO batches are
    padded per micro-batch), and the loss a micro-batch returns is taken as is (`calculate_per_token_loss`: the
    GRPO loss is already normalised by the minibatch's tokens)."""
    from megatron.core.transformer import TransformerConfig  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    check_supported(cfg)
    layout = layout_from_hf_config(cfg)
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=layout.num_heads, num_query_groups=layout.num_kv_heads, kv_channels=layout.head_dim,
        normalization="RMSNorm", layernorm_epsilon=float(cfg.rms_norm_eps),
        qk_layernorm=getattr(cfg, "model_type", "") in ("qwen3", "qwen3_moe"),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        # the local spec runs without TransformerEngine / Apex: every fused kernel off
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # sequence parallelism whenever tensor parallelism is on, as megatron runs it: between the layers each TP rank
        # holds 1/tp of the tokens (activation memory / tp), and megatron trains MoE layers at tensor > 1 only so
        # (`block_spec` says how kora's layers take it)
        tensor_model_parallel_size=tensor, sequence_parallel=tensor > 1,
        pipeline_model_parallel_size=pipeline, variable_seq_lengths=pipeline > 1, calculate_per_token_loss=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, pipeline_dtype=dtype,
        perform_initialization=init,  # False: every base weight is loaded from the HF checkpoint
        # megatron refuses variable_seq_lengths beside its default dispatcher, MoE layers or not; an MoE config's
        # own dispatcher (moe_config_kwargs: {} for a dense config) comes last
        **({"moe_token_dispatcher_type": "alltoall"} if pipeline > 1 else {}) | moe_config_kwargs(
            cfg, moe_dispatcher, expert),
    )


def build_gpt_model(cfg: Any, dtype: torch.dtype = torch.bfloat16, init: bool = False,
                    moe_dispatcher: str = "alltoall") -> Any:
    """GPTModel on this process's GPU for the HF config `cfg` (weights uninitialised: `load_hf_state` next;
    `init=True`: megatron's random init, e.g. a Qwen3-4B-shaped model for bench/gpu_sync.py).

    Needs `init_parallel` first (megatron's parallel_state gives the tensor-parallel group).
    """
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    _, tp = tp_rank_size()
    stage, stages = pp_rank_size()
    if cfg.num_hidden_layers % stages:
        raise ValueError(f"parallelism.pipeline {stages} does not divide the model's {cfg.num_hidden_layers} layers: "
                         "set parallelism.pipeline to a divisor of num_hidden_layers")
    config = transformer_config(cfg, dtype, tp, init, moe_dispatcher, pipeline=stages, expert=ep_rank_size()[1])
    model = GPTModel(
        config=config, transformer_layer_spec=block_spec(config), vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings, pre_process=stage == 0, post_process=stage == stages - 1,
        parallel_output=True,  # logits stay vocab-sharded; token_logprobs reduces over the TP group
        share_embeddings_and_output_weights=bool(getattr(cfg, "tie_word_embeddings", False)),
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=rope_theta(cfg),
    )
    # the torch norms of the local spec are created on the CPU in fp32: one device and dtype for all
    return model.cuda(torch.cuda.current_device()).to(dtype)


def block_spec(config: Any) -> Any:
    """TransformerBlockSubmodules of this pipeline stage's layers (megatron slices its decoder block specs so): the
    local spec's dense layer, the MoE layer (moe.moe_layer_spec) where a Qwen3-MoE's `moe_layer_freq` is 1, and the
    final norm megatron gives the local spec; under sequence parallelism their torch norms are FrozenTokenNorms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415 - megatron-core is optional: this module imports without it
    from megatron.core.transformer.transformer_block import (  # noqa: PLC0415 - megatron-core is optional: this module imports without it
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    dense = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    offset, count = get_transformer_layer_offset(config), get_num_layers_to_build(config)
    if config.num_moe_experts:
        sparse = moe_layer_spec(config)
        layers = [sparse if f else dense for f in config.moe_layer_freq[offset:offset + count]]
    else:
        layers = [dense] * count
    spec = TransformerBlockSubmodules(layer_specs=layers, layer_norm=LayerNormImpl)
    return swap_torch_norms(spec) if config.sequence_parallel else spec


class FrozenTokenNorm:
    """megatron's WrappedTorchNorm (the norm of its local spec without Apex or TransformerEngine) without its refusal
    of sequence parallelism. A norm works token by token, so a rank's share of the sequence is normalised as the
    whole would be; megatron refuses it because the norm's own weight gradient would then be partial on each rank,
    and kora's norms are frozen (only the LoRA factors train)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> Any:
        norm = (torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm)(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def swap_torch_norms(spec: Any) -> Any:
    """`spec` (a ModuleSpec tree, its submodules dataclasses, lists of them, or a module class) with every
    WrappedTorchNorm replaced by FrozenTokenNorm; other norms (Apex's, TransformerEngine's) take sequence
    parallelism themselves."""
    from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: PLC0415 - megatron-core is optional: this module imports without it
    from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    if spec is WrappedTorchNorm:
        return FrozenTokenNorm
    if isinstance(spec, list):
        return [swap_torch_norms(s) for s in spec]
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=swap_torch_norms(spec.module),
                                   submodules=swap_torch_norms(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: swap_torch_norms(getattr(spec, f.name))
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def read_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (*.safetensors), by HF name, on the CPU."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def base_param_name(name: str) -> str | None:
    """Megatron base-parameter name for a (possibly LoRA-wrapped) parameter; None for adapter factors."""
    if ".lora_A." in name or ".lora_B." in name:
        return None
    return name.replace(".base_layer.", ".")


def base_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """This stage's base parameters by global megatron name (LoRA factors left out). A later stage's copy of a tied
    embedding (`output_layer.weight` where the stage has no embedding) is the first stage's to name: left out."""
    numbers = numbering(model)
    tied_copy = bool(getattr(model, "share_embeddings_and_output_weights", False)) and not getattr(
        model, "pre_process", True)
    out = []
    for name, p in model.named_parameters():
        base = base_param_name(name)
        if base is None or (tied_copy and base == "output_layer.weight"):
            continue
        out.append((global_name(base, numbers), p))
    return out


def stage_param_names(model: torch.nn.Module, maps: Mapping[str, Any]) -> set[str]:
    """The megatron names of `maps` this rank holds: its stage's own layers (of their experts, its expert-parallel
    share), the embedding on the first stage, the final norm and the output layer on the last."""
    numbers = numbering(model)
    layers = {f"decoder.layers.{i}." for i in numbers.layers.values()}
    pre, post = getattr(model, "pre_process", True), getattr(model, "post_process", True)

    def mine(name: str) -> bool:
        if name.startswith("decoder.layers."):
            expert = LOCAL_EXPERT.search(name)
            return any(name.startswith(prefix) for prefix in layers) and (
                expert is None or numbers.owns_expert(int(expert.group(1))))
        if name.startswith("embedding."):
            return bool(pre)
        return bool(post)  # decoder.final_layernorm, output_layer

    return {name for name in maps if mine(name)}


@torch.no_grad()
def load_hf_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], layout: Layout) -> None:
    """Copy HF tensors into the model: fused QKV / gate-up layouts, this TP rank's shards. Strict both ways.
    MoE experts may come per expert (checkpoint names) or fused (transformers-5 in-memory `gate_up_proj`)."""
    if layout.num_experts:
        state = unfuse_hf_experts(state)

    tp_rank, tp_size = tp_rank_size()
    maps = {pm.megatron: pm for pm in param_maps(layout)}
    if layout.tied:  # a tied checkpoint may still carry lm_head.weight; it is the embedding
        maps.pop("output_layer.weight", None)
    seen: set[str] = set()
    for base, p in base_parameters(model):
        pm = maps.get(base)
        if pm is None:
            raise KeyError(f"megatron parameter {base} has no HF counterpart in the {layout} mapping")
        missing = [n for n in pm.hf if n not in state]
        if missing:
            raise KeyError(f"HF checkpoint lacks {missing} (for megatron {base})")
        rank, size = (0, 1) if is_expert_module(base) else (tp_rank, tp_size)  # experts: whole (expertTensor 1)
        shard = to_megatron_shard(pm.kind, [state[n] for n in pm.hf], layout, rank, size)
        if tuple(shard.shape) != tuple(p.shape):
            raise ValueError(f"{base}: HF gives {tuple(shard.shape)} on TP rank {tp_rank}, model has {tuple(p.shape)}")
        p.copy_(shard.to(device=p.device, dtype=p.dtype))
        seen.add(base)
    tied_copy = layout.tied and not getattr(model, "pre_process", True) and getattr(model, "post_process", True)
    if tied_copy:  # a last stage's own copy of the tied embedding: the output layer reads it
        out = model.get_parameter("output_layer.weight")
        pm = next(pm for pm in param_maps(layout) if pm.megatron == "embedding.word_embeddings.weight")
        out.copy_(to_megatron_shard(pm.kind, [state[n] for n in pm.hf], layout, tp_rank, tp_size).to(
            device=out.device, dtype=out.dtype))
    unloaded = sorted(stage_param_names(model, maps) - seen)
    if unloaded:
        raise KeyError(f"megatron model has no parameter for {unloaded[:5]}")


def hf_state(model: torch.nn.Module, layout: Layout, flavour: str = "hf", merged: bool = False
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """The base (or, `merged`, the base with every enabled adapter folded in) under HF / SGLang names.

    Collective over the TP group (every rank must iterate): sharded tensors are all-gathered, then unfused.
    A fold is local to each shard (column: W_t + s·B_t·A; row: W_t + s·B·A_t are exactly the shards of the
    full fold), computed in fp32 and rounded once (kernels.fold), before the gather.
    """
    wrapped = {f"{name}.weight": m for name, m in lora_modules(model).items()} if merged else {}
    maps = {pm.megatron: pm for pm in param_maps(layout)}
    hf_names = {pm.megatron: pm for pm in param_maps(layout, flavour)}
    for base, p in base_parameters(model):
        yield from param_hf_tensors(p, maps[base].kind, hf_names[base].hf, wrapped.get(base), layout,
                                    whole=is_expert_module(base))


def param_hf_tensors(p: torch.Tensor, kind: str, hf: tuple[str, ...], lora: Any, layout: Layout, whole: bool = False
                     ) -> list[tuple[str, torch.Tensor]]:
    """One megatron base parameter as its HF tensors; `lora` (a wrapper or None) is folded in when enabled.
    Collective over the TP group for sharded kinds, unless `whole` (an expert's: never split by TP)."""
    local = p.detach()
    if lora is not None and lora.enabled:
        local = fold(local, lora.lora_A.weight.detach(), lora.lora_B.weight.detach(), lora.scaling)
    shards = [local] if kind == REPL or whole else gather_tp(local)
    return list(zip(hf, from_megatron_shards(kind, shards, layout), strict=True))
