"""Weight sync from the megatron policy: the same three modes as the torch backend, under HF / SGLang names.

- `MegatronWeightSender`: `sync.sender.WeightSender` (HTTP metadata + NCCL/gloo or in-memory transport, the
  engine routes, checksums, collective delta-skip) with the megatron model's sources: Merge pushes
  `hf_state(merged=True)` one bucket at a time, Adapter pushes the base once then `hf_adapter_tensors`,
  EngineMerge pushes the A/B pairs. Works at any TP size for the delta-skip; the pushes gather TP shards, so
  with TP > 1 every TP rank must produce the same buckets — not wired yet (raises).
- `merge_entries` / `adapter_specs`: the GPU fast path's plan (`sync/fast.py`) for TP = 1: which megatron
  tensor (and which rows of it) each HF tensor is, so the fold writes megatron's fused QKV straight into HF's
  q, k, v layout inside the sync bucket (`qkv_row_map`) and the adapter is one gather.

megatron-core is imported lazily (through lora.py / model.py helpers): this module imports without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kora_trainer.backends.megatron.convert import (
    FC1,
    PEFT_PREFIX,
    QKV,
    Layout,
    adapter_modules,
    from_megatron_shards,
    param_maps,
)
from kora_trainer.backends.megatron.lora import lora_modules
from kora_trainer.backends.megatron.model import base_param_name, param_hf_tensors
from kora_trainer.sync.fast import Entry, FoldEntry, GatherSpec, PlainEntry
from kora_trainer.sync.sender import WeightSender
from kora_trainer.sync.sources import Source

Named = tuple[str, torch.Tensor]


def qkv_row_map(layout: Layout) -> torch.Tensor:
    """[ng·(h/ng+2)·d] int32: the row of cat(q, k, v) (HF) that each row of megatron's fused QKV becomes."""
    from kora_trainer.backends.megatron.convert import split_qkv

    rows = layout.num_kv_heads * (layout.heads_per_group + 2) * layout.head_dim
    q, k, v = split_qkv(torch.arange(rows), layout)  # fused row ids in HF order
    order = torch.cat([q, k, v])
    out = torch.empty(rows, dtype=torch.int32)
    out[order] = torch.arange(rows, dtype=torch.int32)
    return out


def _check_tp1(model: nn.Module) -> None:
    from kora_trainer.backends.megatron.parallel import tp_rank_size

    if tp_rank_size()[1] != 1:
        raise NotImplementedError("the fast sync plan is built for tensor parallel size 1 (TP > 1 needs a gather "
                                  "of the shards into the bucket: next step)")


def _meta_outs(kind: str, shape: torch.Size, hf: Sequence[str], layout: Layout) -> list[tuple[str, tuple[int, ...]]]:
    outs = from_megatron_shards(kind, [torch.empty(shape, device="meta")], layout)
    return [(n, tuple(t.shape)) for n, t in zip(hf, outs, strict=True)]


def merge_entries(model: nn.Module, layout: Layout, merged: bool = True, flavour: str = "hf") -> list[Entry]:
    """The model under HF names as fast-sync entries (TP = 1): enabled adapters folded in when `merged`."""
    _check_tp1(model)
    wrapped = {f"{name}.weight": m for name, m in lora_modules(model).items()} if merged else {}
    maps = {pm.megatron: pm for pm in param_maps(layout, flavour)}
    device = next(model.parameters()).device
    qkv_map = qkv_row_map(layout).to(device)
    entries: list[Entry] = []
    for name, p in model.named_parameters():
        base = base_param_name(name)
        if base is None:
            continue
        pm = maps[base]
        w = p.detach()
        m = wrapped.get(base)
        lora = m is not None and m.enabled
        a = m.lora_A.weight.detach() if lora else None
        b = m.lora_B.weight.detach() if lora else None
        scale = float(m.scaling) if lora else 1.0
        if pm.kind == QKV and w.dim() == 2:
            entries.append(FoldEntry(_meta_outs(pm.kind, w.shape, pm.hf, layout), w, a, b, scale, qkv_map))
        elif lora:  # linear_proj / linear_fc2 (one HF tensor) or linear_fc1 ([gate; up] rows at TP 1)
            entries.append(FoldEntry(_meta_outs(pm.kind, w.shape, pm.hf, layout), w, a, b, scale))
        elif pm.kind == FC1:
            gate, up = w.chunk(2, dim=0)
            entries += [PlainEntry(pm.hf[0], gate), PlainEntry(pm.hf[1], up)]
        elif pm.kind == QKV:  # a QKV bias [rows]: unfuse on the host side of the plan (small)
            for n, t in zip(pm.hf, from_megatron_shards(QKV, [w], layout), strict=True):
                entries.append(PlainEntry(n, t.contiguous()))
        else:
            entries.append(PlainEntry(pm.hf[0], w))
    return entries


def adapter_specs(model: nn.Module, layout: Layout, flavour: str = "hf") -> list[GatherSpec]:
    """Every HF-PEFT adapter tensor as rows of a megatron LoRA parameter (TP = 1), pairs adjacent."""
    _check_tp1(model)
    from kora_trainer.backends.megatron.export import _targets

    mapping = adapter_modules(layout, _targets(model), flavour)
    qkv_rows = None
    specs: list[GatherSpec] = []
    for name, m in lora_modules(model).items():
        hf_modules, kind = mapping[name]
        a, b = m.lora_A.weight, m.lora_B.weight
        if kind == QKV:
            if qkv_rows is None:
                inv = torch.argsort(qkv_row_map(layout).long())  # HF row j <- fused row inv[j]
                hq = layout.num_heads * layout.head_dim
                hk = layout.num_kv_heads * layout.head_dim
                qkv_rows = [inv[:hq], inv[hq:hq + hk], inv[hq + hk:]]
            rows: list[torch.Tensor | None] = list(qkv_rows)
        elif kind == FC1:
            f = b.shape[0] // 2
            rows = [torch.arange(f), torch.arange(f, 2 * f)]
        else:
            rows = [None]
        for module, r in zip(hf_modules, rows, strict=True):
            specs.append(GatherSpec(f"{PEFT_PREFIX}{module}.lora_A.weight", a))
            specs.append(GatherSpec(f"{PEFT_PREFIX}{module}.lora_B.weight", b, r))
    return specs


# ---- the HTTP path: WeightSender with megatron sources ------------------------------------------------------

def _meta(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def megatron_source(model: nn.Module, layout: Layout, merged: bool, flavour: str = "hf") -> Source:
    """The base (or merged) model under HF names; each bucket's tensors are made when it goes out."""
    wrapped = {f"{name}.weight": m for name, m in lora_modules(model).items()} if merged else {}
    maps = {pm.megatron: pm for pm in param_maps(layout, flavour)}
    params = {}
    groups: list[list[Named]] = []
    owner: dict[str, str] = {}
    for name, p in model.named_parameters():
        base = base_param_name(name)
        if base is None:
            continue
        pm = maps[base]
        params[base] = p
        for hf_name, shape in _meta_outs(pm.kind, p.shape, pm.hf, layout):
            groups.append([(hf_name, _meta(shape, p.dtype))])
            owner[hf_name] = base

    def get(names: Sequence[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for base in dict.fromkeys(owner[n] for n in names):
            pm = maps[base]
            out.update(param_hf_tensors(params[base], pm.kind, pm.hf, wrapped.get(base), layout))
        return {n: out[n].contiguous() for n in names}

    return Source(groups, get)


def megatron_adapter_source(model: nn.Module, layout: Layout, flavour: str = "hf") -> Source:
    """The adapter under HF-PEFT names, each lora_A/lora_B pair one group (never split)."""
    from kora_trainer.backends.megatron.export import hf_adapter_tensors

    first = hf_adapter_tensors(model, layout, flavour)  # shapes for the plan (values re-read per push)
    pairs: dict[str, list[Named]] = {}
    for n, t in first.items():
        pairs.setdefault(n.split(".lora_")[0], []).append((n, _meta(t.shape, t.dtype)))
    groups = [sorted(g, key=lambda nt: nt[0]) for g in pairs.values()]  # lora_A before lora_B

    def get(names: Sequence[str]) -> dict[str, torch.Tensor]:
        tensors = hf_adapter_tensors(model, layout, flavour)
        return {n: tensors[n].contiguous() for n in names}

    return Source(groups, get)


class MegatronWeightSender(WeightSender):
    """`WeightSender` for a megatron policy (`MegatronBackend.model`)."""

    def __init__(self, model: nn.Module, layout: Layout, cfg: Any, transport: Any, trainer_group: Any = None,
                 verify: bool = True, flavour: str = "hf"):
        self.layout, self.flavour = layout, flavour
        self._adapter_src: Source | None = None
        super().__init__(model, cfg, transport, trainer_group, verify)

    def make_adapter_config(self) -> dict[str, Any]:
        from kora_trainer.backends.megatron.export import peft_config

        return peft_config(self.model, self.cfg.lora, self.cfg.model.path)

    def adapter_named(self) -> list[Named]:
        return [(f"{n}.lora_{w}", getattr(m, f"lora_{w}").weight.detach())
                for n, m in lora_modules(self.model).items() for w in "AB"]

    def _tp1(self) -> None:
        if self.transport is not None:
            _check_tp1(self.model)

    def merged_source(self) -> Source:
        self._tp1()
        return megatron_source(self.model, self.layout, True, self.flavour)

    def base_source(self) -> Source:
        self._tp1()
        return megatron_source(self.model, self.layout, False, self.flavour)

    def adapter_source(self) -> Source:
        self._tp1()
        if self._adapter_src is None:  # the plan (names, shapes) is fixed: one export per push, not two
            self._adapter_src = megatron_adapter_source(self.model, self.layout, self.flavour)
        return self._adapter_src
