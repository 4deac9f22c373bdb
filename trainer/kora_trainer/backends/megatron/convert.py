"""HF <-> Megatron-core tensor layouts and names for Qwen3-style dense and MoE models. Pure torch: no megatron
import, so the layout logic is tested on CPU and shared by weight loading, sync and export.

Megatron fuses what HF keeps apart, and tensor parallelism (TP) shards the fused tensors:

| megatron parameter (per layer `decoder.layers.{i}.`)  | HF (`model.layers.{i}.`)           | kind    |
| ---                                                   | ---                                | ---     |
| `self_attention.linear_qkv.weight` [ng·(h/ng+2)·d, H]  | `self_attn.{q,k,v}_proj.weight`    | QKV     |
| `self_attention.{q,k}_layernorm.weight` [d]          | `self_attn.{q,k}_norm.weight`      | REPL    |
| `self_attention.linear_proj.weight` [H, h·d]          | `self_attn.o_proj.weight`          | ROW     |
| `mlp.linear_fc1.weight` [2F, H]                       | `mlp.{gate,up}_proj.weight`        | FC1     |
| `mlp.linear_fc2.weight` [H, F]                        | `mlp.down_proj.weight`             | ROW     |
| `input_layernorm` / `pre_mlp_layernorm`               | `input_layernorm` / `post_attention_layernorm` | REPL |
| `embedding.word_embeddings.weight` [V, H]             | `model.embed_tokens.weight`        | COLUMN  |
| `decoder.final_layernorm.weight`                      | `model.norm.weight`                | REPL    |
| `output_layer.weight` [V, H] (absent when tied)       | `lm_head.weight`                   | COLUMN  |

Qwen3-MoE layers (`Layout.moe_layers`; see moe.py) replace `mlp.linear_fc{1,2}` by the router and the experts
(HF names as a Qwen3-MoE checkpoint stores them, one module per expert; transformers 5 fuses them in memory
into `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I], which `hf_experts.unfuse_hf_experts`
splits back):

| megatron parameter (per MoE layer)                          | HF                                    | kind |
| ---                                                         | ---                                   | ---  |
| `mlp.router.weight` [E, H]                                  | `mlp.gate.weight`                     | REPL |
| `mlp.experts.local_experts.{e}.linear_fc1.weight` [2I, H]   | `mlp.experts.{e}.{gate,up}_proj.weight` | FC1 |
| `mlp.experts.local_experts.{e}.linear_fc2.weight` [H, I]    | `mlp.experts.{e}.down_proj.weight`    | ROW  |

- QKV: rows grouped per KV group g: [q heads of g (h/ng·d rows), k_g (d rows), v_g (d rows)], groups in
  order (megatron `SelfAttention.get_query_key_value_tensors`). TP rank t holds groups [t·ng/tp, (t+1)·ng/tp),
  which is a contiguous row chunk of the full interleaved tensor.
- FC1: [gate; up] stacked on rows (megatron's GLU takes `chunk(2)`: first half gated by silu). Under TP each
  rank stacks ITS shards, [gate_t; up_t], so the TP-concatenation of shards is NOT [gate; up].
- COLUMN: a contiguous row chunk per rank (vocab-parallel embedding / output layer). ROW: a column chunk.

The same kinds describe LoRA factors (see lora.py): a column-parallel wrapper's B has the base weight's row
layout (QKV / FC1 / COLUMN) and its A is replicated; a row-parallel wrapper's A has the base weight's column
layout (ROW) and its B is replicated; the router's LoRA (REPL) has both factors whole on every rank. The MoE
experts' LoRA is named by moe.py (PEFT's grouped layout), not here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kora_trainer.config import MEGATRON_TO_HF, MEGATRON_TO_SGLANG, TargetModule

REPL, COLUMN, ROW, QKV, FC1 = "replicated", "column", "row", "qkv", "fc1"
PEFT_PREFIX = "base_model.model."
FLAVOURS = {"hf": MEGATRON_TO_HF, "sglang": MEGATRON_TO_SGLANG}


@dataclass(frozen=True)
class Layout:
    """The shape facts the conversions need (from an HF config: `layout_from_hf_config`)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool = False
    qkv_bias: bool = False
    num_experts: int = 0  # Qwen3-MoE: experts per MoE layer (0: dense model)
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the routed experts (the rest are dense MLPs)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def moe_layer_indices(cfg: Any) -> tuple[int, ...]:
    """The layers of an HF Qwen3-MoE config whose MLP is sparse (HF's rule: not in `mlp_only_layers`, and
    `(i + 1) % decoder_sparse_step == 0`); () for a dense config."""
    experts = int(getattr(cfg, "num_experts", 0) or 0)
    if experts <= 0:
        return ()
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return tuple(i for i in range(cfg.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


def layout_from_hf_config(cfg: Any) -> Layout:
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    moe_layers = moe_layer_indices(cfg)
    return Layout(num_layers=cfg.num_hidden_layers, num_heads=heads,
                  num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
                  tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                  qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                  num_experts=int(getattr(cfg, "num_experts", 0) or 0) if moe_layers else 0, moe_layers=moe_layers)


@dataclass(frozen=True)
class ParamMap:
    megatron: str  # full megatron parameter name (base layer; a LoRA wrapper adds `.base_layer`)
    hf: tuple[str, ...]  # HF state-dict names, in the order the kind fuses them
    kind: str


# megatron module (under decoder.layers.{i}.) -> (HF module path under model.layers.{i}., target, kind)
_LINEARS: dict[str, tuple[str, TargetModule, str]] = {
    "self_attention.linear_qkv": ("self_attn", TargetModule.LINEAR_QKV, QKV),
    "self_attention.linear_proj": ("self_attn", TargetModule.LINEAR_PROJ, ROW),
    "mlp.linear_fc1": ("mlp", TargetModule.LINEAR_FC1, FC1),
    "mlp.linear_fc2": ("mlp", TargetModule.LINEAR_FC2, ROW),
}
# the modules LoRA can wrap: the linears, and an MoE layer's router (its bare [E, H] weight; lora.LoRARouter)
_ADAPTED = {**_LINEARS, "mlp.router": ("mlp", TargetModule.ROUTER, REPL)}
TARGET_OF = {leaf.rsplit(".", 1)[-1]: target for leaf, (_, target, _) in _ADAPTED.items()}
_LAYER_MODULE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _layer_maps(i: int, layout: Layout, flavour: str) -> list[ParamMap]:
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    names = FLAVOURS[flavour]
    out = [
        ParamMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), REPL),
        ParamMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), REPL),
        ParamMap(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), REPL),
        ParamMap(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), REPL),
    ]
    for module, (hf_parent, target, kind) in _LINEARS.items():
        if i in layout.moe_layers and module.startswith("mlp."):
            continue
        leaves = names[target]
        out.append(ParamMap(f"{m}{module}.weight", tuple(f"{h}{hf_parent}.{leaf}.weight" for leaf in leaves), kind))
        if kind == QKV and layout.qkv_bias:
            out.append(ParamMap(f"{m}{module}.bias", tuple(f"{h}{hf_parent}.{leaf}.bias" for leaf in leaves), kind))
    if i in layout.moe_layers:
        out += _moe_maps(i, layout, flavour)
    return out


def _moe_maps(i: int, layout: Layout, flavour: str) -> list[ParamMap]:
    """A Qwen3-MoE layer's router and experts (megatron SequentialMLP, expert parallel size 1)."""
    m, h = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    names = FLAVOURS[flavour]
    (router,) = names[TargetModule.ROUTER]
    out = [ParamMap(f"{m}router.weight", (f"{h}{router}.weight",), REPL)]
    for e in range(layout.num_experts):
        for leaf, target, kind in (("linear_fc1", TargetModule.LINEAR_FC1, FC1),
                                   ("linear_fc2", TargetModule.LINEAR_FC2, ROW)):
            out.append(ParamMap(f"{m}experts.local_experts.{e}.{leaf}.weight",
                                tuple(f"{h}experts.{e}.{p}.weight" for p in names[target]), kind))
    return out


def param_maps(layout: Layout, flavour: str = "hf") -> list[ParamMap]:
    """Every base parameter of the megatron GPTModel with its HF (or SGLang) names, in model order."""
    out = [ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), COLUMN)]
    for i in range(layout.num_layers):
        out += _layer_maps(i, layout, flavour)
    out.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), REPL))
    if not layout.tied:
        out.append(ParamMap("output_layer.weight", ("lm_head.weight",), COLUMN))
    return out


def adapter_modules(layout: Layout, targets: Sequence[TargetModule | str], flavour: str = "hf"
                    ) -> dict[str, tuple[tuple[str, ...], str]]:
    """megatron module path -> (HF module paths it stands for, kind), for the LoRA-targeted linears and routers
    (the MoE experts' LoRA is named by moe.py, in PEFT's grouped layout)."""
    wanted = {TargetModule(t) for t in targets}
    out: dict[str, tuple[tuple[str, ...], str]] = {}
    for i in range(layout.num_layers):
        moe = i in layout.moe_layers
        for module, (_, target, _) in _ADAPTED.items():
            if target not in wanted or (module.startswith("mlp.") and moe != (module == "mlp.router")):
                continue  # an MoE layer has a router and experts, a dense layer linear_fc1 / linear_fc2
            name = f"decoder.layers.{i}.{module}"
            out[name] = hf_adapter_module(name, flavour)
    return out


def hf_adapter_module(name: str, flavour: str = "hf") -> tuple[tuple[str, ...], str]:
    """One LoRA-wrapped megatron module path (`decoder.layers.{i}.<module>`) -> (HF module paths, kind)."""
    m = _LAYER_MODULE.match(name)
    if m is None or m.group(2) not in _ADAPTED:
        raise KeyError(f"{name}: not a megatron module with an HF-PEFT name (experts: see moe.py)")
    i, module = m.groups()
    hf_parent, target, kind = _ADAPTED[module]
    return tuple(f"model.layers.{i}.{hf_parent}.{leaf}" for leaf in FLAVOURS[flavour][target]), kind


# ---- layouts ------------------------------------------------------------------------------------------

def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of {tuple(t.shape)} does not split over tensor parallel size {size}")
    return t.chunk(size, dim=dim)[rank]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """HF q [h·d, ...], k/v [ng·d, ...] -> megatron interleaved [ng·(h/ng+2)·d, ...] (full, all TP ranks)."""
    ng, rest = layout.num_kv_heads, q.shape[1:]
    qg = q.reshape(ng, layout.heads_per_group * layout.head_dim, *rest)
    kg = k.reshape(ng, layout.head_dim, *rest)
    vg = v.reshape(ng, layout.head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Inverse of `fuse_qkv`: full interleaved [ng·(h/ng+2)·d, ...] -> [q, k, v]."""
    ng, d, rest = layout.num_kv_heads, layout.head_dim, fused.shape[1:]
    g = fused.reshape(ng, (layout.heads_per_group + 2) * d, *rest)
    q, k, v = g.split([layout.heads_per_group * d, d, d], dim=1)
    return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


def to_megatron_shard(kind: str, hf: Sequence[torch.Tensor], layout: Layout, tp_rank: int = 0,
                      tp_size: int = 1) -> torch.Tensor:
    """HF tensors (in ParamMap.hf order) -> this TP rank's megatron shard."""
    if kind == REPL:
        return hf[0]
    if kind == COLUMN:
        return _chunk(hf[0], 0, tp_rank, tp_size)
    if kind == ROW:
        return _chunk(hf[0], 1, tp_rank, tp_size)
    if kind == QKV:
        if layout.num_kv_heads % tp_size:
            raise ValueError(f"{layout.num_kv_heads} KV heads do not split over tensor parallel size {tp_size}")
        return _chunk(fuse_qkv(hf[0], hf[1], hf[2], layout), 0, tp_rank, tp_size)
    if kind == FC1:
        gate, up = hf
        return torch.cat([_chunk(gate, 0, tp_rank, tp_size), _chunk(up, 0, tp_rank, tp_size)], dim=0)
    raise ValueError(f"unknown layout kind {kind!r}")


def from_megatron_shards(kind: str, shards: Sequence[torch.Tensor], layout: Layout) -> list[torch.Tensor]:
    """All TP ranks' shards (rank order) -> the HF tensors (ParamMap.hf order)."""
    if kind == REPL:
        return [shards[0]]
    if kind == COLUMN:
        return [torch.cat(list(shards), dim=0)]
    if kind == ROW:
        return [torch.cat(list(shards), dim=1)]
    if kind == QKV:
        return split_qkv(torch.cat(list(shards), dim=0), layout)
    if kind == FC1:
        halves = [s.chunk(2, dim=0) for s in shards]  # each rank: [gate_t; up_t]
        return [torch.cat([g for g, _ in halves], dim=0), torch.cat([u for _, u in halves], dim=0)]
    raise ValueError(f"unknown layout kind {kind!r}")


# ---- LoRA factors -------------------------------------------------------------------------------------

def column_parallel(kind: str) -> bool:
    return kind in (QKV, FC1, COLUMN)


def adapter_to_hf(hf_modules: Sequence[str], kind: str, a_shards: Sequence[torch.Tensor],
                  b_shards: Sequence[torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """One megatron LoRA (all TP ranks' A and B) -> HF-PEFT tensors `base_model.model.<module>.lora_{A,B}.weight`.

    A fused linear (linear_qkv, linear_fc1) has ONE A shared by the HF projections it stands for: each HF
    module gets a copy of A and its own rows of B. That is exact — B_q·A, B_k·A, B_v·A are the row blocks of
    B·A — so PEFT, SGLang and kora's engine compute the same policy with rank r.
    """
    if column_parallel(kind):
        a = a_shards[0]  # replicated across TP
        bs = from_megatron_shards(kind, b_shards, layout)
    else:
        a = torch.cat(list(a_shards), dim=1)  # [r, in]
        bs = [b_shards[0]]  # replicated
    out = {}
    for i, (module, b) in enumerate(zip(hf_modules, bs, strict=True)):
        # own storage per projection: safetensors refuses tensors that share memory
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a if i == 0 else a.clone()
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
    return out


def adapter_from_hf(hf_modules: Sequence[str], kind: str, tensors: dict[str, torch.Tensor], layout: Layout,
                    tp_rank: int = 0, tp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-PEFT tensors -> this TP rank's (A, B) of the megatron LoRA. Inverse of `adapter_to_hf`.

    A fused megatron linear shares one A, so the HF projections it fuses must carry the same lora_A (as every
    adapter this backend exports does). An adapter trained elsewhere with distinct A's per projection is
    rejected with a clear message rather than silently approximated.
    """
    a_list = [tensors[f"{PEFT_PREFIX}{m}.lora_A.weight"] for m in hf_modules]
    b_list = [tensors[f"{PEFT_PREFIX}{m}.lora_B.weight"] for m in hf_modules]
    if kind == REPL:  # the router: both factors whole on every rank
        return a_list[0], b_list[0]
    if column_parallel(kind):
        if any(not torch.equal(a_list[0], a) for a in a_list[1:]):
            raise ValueError(f"{', '.join(hf_modules)}: lora_A differs between the projections a fused megatron "
                             "linear shares one A for; load it with the torch backend, or retrain with this one")
        return a_list[0], to_megatron_shard(kind, b_list, layout, tp_rank, tp_size)
    return _chunk(a_list[0], 1, tp_rank, tp_size), b_list[0]
