"""Weight sync from the megatron policy: the same three modes as the torch backend, under HF / SGLang names.

- `MegatronWeightSender`: `sync.sender.WeightSender` (HTTP metadata + NCCL/gloo or in-memory transport, the
  engine routes, checksums, collective delta-skip) with the megatron model's sources: Merge pushes
  `hf_state(merged=True)` one bucket at a time, Adapter pushes the base once then `hf_adapter_tensors`,
  EngineMerge pushes the A/B pairs. Under tensor parallelism the sources all-gather shards over the TP group,
  so every TP rank constructs the sender and calls `sync()`: the rank given the transport (TP rank 0; under
  Colocate every rank with an engine beside it) talks to the engines, the others get a `sender.follower`
  transport (found at construction, one small collective) and run the same buckets, gathers included, sending
  nothing. The delta-skip's MAX runs over the TP group unless a
  `trainer_group` is given.
- `merge_entries` / `adapter_specs`: the GPU fast path's plan (`sync/fast/plan.py`): which megatron tensor (and
  which rows of it) each HF tensor is, so the fold writes megatron's fused QKV straight into HF's q, k, v
  layout inside the sync bucket (`qkv_row_map`) and the adapter is one gather. Under TP each rank plans its
  own shards (`FoldEntry.tp_dim`, `GatherSpec.split`) and `plan.PipelinedSender` / `adapter_pack.AdapterPack` gather
  them to TP rank 0 over `tp_group()`. `MegatronWeightSender` hands them to the trainer's fast path
  (`sync/fast/`, as its `PolicyPlan`) at TP = 1 for dense models.
- Pipeline stages and expert parallelism: each rank's sources name its own layers and experts (global indices);
  `across_ranks` makes them the whole model's, every tensor broadcast from its owner over the expert-parallel, then
  the pipeline group when its bucket goes out, so the rank that holds the transport (rank 0; under Colocate every
  rank with an engine) pushes the whole policy and the others of its model copy follow (`_tp_transport` over
  `model_parallel_group()`). The fast path is wired for one stage and no expert parallelism: such jobs take the HTTP
  path, with the reason printed.

megatron-core is imported lazily (through lora.py / model.py helpers): this module imports without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kora_trainer.backends.megatron import parallel  # called as parallel.X(): tests put a fake rank layout there
from kora_trainer.backends.megatron.convert import (
    FC1,
    PEFT_PREFIX,
    QKV,
    REPL,
    ROW,
    Layout,
    adapter_modules,
    column_parallel,
    from_megatron_shards,
    param_maps,
    split_qkv,
)
from kora_trainer.backends.megatron.export import _targets, hf_adapter_tensors, peft_config
from kora_trainer.backends.megatron.lora import adapter_parameters, all_lora_modules, lora_modules
from kora_trainer.backends.megatron.model import base_parameters, param_hf_tensors
from kora_trainer.backends.megatron.moe import is_expert_module
from kora_trainer.backends.megatron.parallel import pp_rank_size
from kora_trainer.sync.fast.plan import Entry, FoldEntry, GatherSpec, PlainEntry
from kora_trainer.sync.sender import WeightSender, follower
from kora_trainer.sync.sources import Source
from kora_trainer.sync.transport import ColocatedTransport, DistributedTransport
from kora_trainer.wire.group import WeightUpdateGroup

Named = tuple[str, torch.Tensor]


def qkv_row_map(layout: Layout) -> torch.Tensor:
    """[ng·(h/ng+2)·d] int32: the row of cat(q, k, v) (HF) that each row of megatron's fused QKV becomes."""
    rows = layout.num_kv_heads * (layout.heads_per_group + 2) * layout.head_dim
    q, k, v = split_qkv(torch.arange(rows), layout)  # fused row ids in HF order
    order = torch.cat([q, k, v])
    out = torch.empty(rows, dtype=torch.int32)
    out[order] = torch.arange(rows, dtype=torch.int32)
    return out


def tp_group() -> WeightUpdateGroup | None:
    """megatron's tensor-parallel group as a `WeightUpdateGroup` (its own ranks), None at TP = 1."""
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return WeightUpdateGroup.wrap(parallel_state.get_tensor_model_parallel_group())


def model_parallel_group() -> WeightUpdateGroup | None:
    """The ranks that hold one copy of the model between them, as a `WeightUpdateGroup`: megatron's model-parallel
    group (TP x PP), or with expert parallelism its expert group (expertTensor x EP x PP: the experts are carved out
    of the data ranks); None when the model is not split."""
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    if parallel.ep_rank_size()[1] > 1:
        return WeightUpdateGroup.wrap(parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    if _tp_size() == 1 and pp_rank_size()[1] == 1:
        return None
    return WeightUpdateGroup.wrap(parallel_state.get_model_parallel_group())


def across_ranks(src: Source, model: nn.Module, experts_whole: bool = False) -> Source:
    """This rank's Source as the whole model's (itself when nothing is split but TP, which the sources gather):
    the expert-parallel ranks' experts joined (unless `experts_whole`: the source already gathers them, as the
    adapter's does for PEFT's grouped layout), then the pipeline stages' layers (`_joined`)."""
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    device = next(model.parameters()).device
    if parallel.ep_rank_size()[1] > 1 and not experts_whole:
        src = _joined(src, parallel_state.get_expert_model_parallel_group(), device)
    if pp_rank_size()[1] > 1:
        src = _joined(src, parallel_state.get_pipeline_model_parallel_group(), device)
    return src


def _joined(src: Source, group: Any, device: torch.device) -> Source:
    """`src` of every rank of `group` as one Source: the plan is every member's groups, each name once (the first
    member holding it owns it: the others hold a replica), in member order; `get` is a collective of the group
    (every member asks for the same names in the same order, and calls its own `src.get` once, maybe for none),
    each tensor broadcast from its owner. A member reads the replicas it holds too: its source's own collectives
    (the TP gather) need every rank that holds a name to ask for it, and under tensor x expert parallelism the
    members of `group` can be one another's TP peers."""
    plan = [[(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in g] for g in src.groups]
    plans: list[Any] = [None] * group.size()
    dist.all_gather_object(plans, (plan, None if src.adapted is None else sorted(src.adapted)), group=group)
    # the names a Merge fold changes, over every member (None where one member cannot say: then all of them)
    adapted = None if any(a is None for _, a in plans) else frozenset(n for _, a in plans for n in a)
    plans = [p for p, _ in plans]
    ranks = dist.get_process_group_ranks(group)  # global rank of each member, in member order
    me = group.rank()
    groups: list[list[Named]] = []
    meta: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
    for member, member_plan in enumerate(plans):
        for g in member_plan:
            if g[0][0] in meta:
                continue  # a replica of a group an earlier member owns
            groups.append([(n, _meta(shape, getattr(torch, dtype))) for n, shape, dtype in g])
            meta.update({n: (member, shape, getattr(torch, dtype)) for n, shape, dtype in g})

    held = {n for g in src.groups for n, _ in g}

    def get(names: Sequence[str]) -> dict[str, torch.Tensor]:
        mine = src.get([n for n in names if n in held])  # may be a collective inside (TP, experts): once
        out: dict[str, torch.Tensor] = {}
        for n in names:
            member, shape, dtype = meta[n]
            t = mine[n].contiguous() if member == me else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=ranks[member], group=group)
            out[n] = t
        return out

    return Source(groups, get, adapted)


def _tp_size() -> int:
    return parallel.tp_rank_size()[1]


def _local_layout(layout: Layout, tp: int) -> Layout:
    """The attention layout of one TP rank's QKV shard (its KV groups, whole)."""
    return replace(layout, num_heads=layout.num_heads // tp, num_kv_heads=layout.num_kv_heads // tp)


def _tp_dim(kind: str, tp: int) -> int | None:
    """How a kind's tensor is split over TP ranks (fast.FoldEntry.tp_dim): None if it is not."""
    if tp == 1 or kind == REPL:
        return None
    return 1 if kind == ROW else 0


def _meta_outs(kind: str, shape: torch.Size, hf: Sequence[str], layout: Layout, tp: int = 1
               ) -> list[tuple[str, tuple[int, ...]]]:
    """The full HF tensors (names, shapes) one megatron parameter of this shard `shape` stands for."""
    outs = from_megatron_shards(kind, [torch.empty(shape, device="meta")] * (1 if kind == REPL else tp), layout)
    return [(n, tuple(t.shape)) for n, t in zip(hf, outs, strict=True)]


def merge_entries(model: nn.Module, layout: Layout, merged: bool = True, flavour: str = "hf") -> list[Entry]:
    """The model under HF names as fast-sync entries: enabled adapters folded in when `merged`. Under TP, this
    rank's shards (sharded kinds become `FoldEntry`s with `tp_dim`; `plan.MergePlan` lays every rank's out)."""
    tp = _tp_size()
    wrapped = {f"{name}.weight": m for name, m in lora_modules(model).items()} if merged else {}
    maps = {pm.megatron: pm for pm in param_maps(layout, flavour)}
    device = next(model.parameters()).device
    qkv_map = qkv_row_map(_local_layout(layout, tp)).to(device)  # this rank's fused rows -> [q_t; k_t; v_t]
    entries: list[Entry] = []
    for base, p in base_parameters(model):
        pm = maps[base]
        w = p.detach()
        m = wrapped.get(base)
        lora = m is not None and m.enabled
        a = m.lora_A.weight.detach() if m is not None and lora else None
        b = m.lora_B.weight.detach() if m is not None and lora else None
        scale = float(m.scaling) if m is not None and lora else 1.0
        outs = _meta_outs(pm.kind, w.shape, pm.hf, layout, tp)
        dim = _tp_dim(pm.kind, tp)
        if pm.kind == QKV and w.dim() == 2:
            entries.append(FoldEntry(outs, w, a, b, scale, qkv_map, dim, tp))
        elif lora:  # linear_proj / linear_fc2 (one HF tensor) or linear_fc1 ([gate; up] rows of this rank)
            entries.append(FoldEntry(outs, w, a, b, scale, None, dim, tp))
        elif dim is not None:  # TP > 1, an unadapted shard: gathered to rank 0 (a QKV bias row-mapped as [M, 1])
            row_map = qkv_map if pm.kind == QKV else None
            entries.append(FoldEntry(outs, w if w.dim() == 2 else w.unsqueeze(1), None, None, 1.0, row_map, dim, tp))
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
    """Every HF-PEFT adapter tensor as rows of a megatron LoRA parameter, pairs adjacent. Under TP the rows index
    the full factor (the TP ranks' shards concatenated along `GatherSpec.split`)."""
    tp = _tp_size()
    mapping = adapter_modules(layout, _targets(model), flavour)
    qkv_rows = None
    specs: list[GatherSpec] = []
    for name, m in lora_modules(model).items():
        if name not in mapping:
            raise NotImplementedError(f"{name}: the fast path's adapter plan covers the attention / MLP linears and "
                                      "routers; MoE experts' adapters go through the HTTP path (MegatronWeightSender)")
        hf_modules, kind = mapping[name]
        a, b = m.lora_A.weight, m.lora_B.weight
        # a column-parallel linear's B is sharded on rows (A whole), a row-parallel one's A on columns (B whole)
        a_split = 1 if kind == ROW else None
        b_split = 0 if column_parallel(kind) else None
        if kind == QKV:  # the full B has megatron's fused rows (the shards are contiguous row blocks of it)
            if qkv_rows is None:
                inv = torch.argsort(qkv_row_map(layout).long())  # HF row j <- fused row inv[j]
                hq = layout.num_heads * layout.head_dim
                hk = layout.num_kv_heads * layout.head_dim
                qkv_rows = [inv[:hq], inv[hq:hq + hk], inv[hq + hk:]]
            rows: list[torch.Tensor | None] = list(qkv_rows)
        elif kind == FC1:  # the full B is [gate_0; up_0; gate_1; up_1; ...]: f rows each
            f = b.shape[0] // 2
            gate = (torch.arange(tp).unsqueeze(1) * 2 * f + torch.arange(f).unsqueeze(0)).reshape(-1)
            rows = [gate, gate + f]
        else:
            rows = [None]
        for module, r in zip(hf_modules, rows, strict=True):
            specs.append(GatherSpec(f"{PEFT_PREFIX}{module}.lora_A.weight", a, None, a_split))
            specs.append(GatherSpec(f"{PEFT_PREFIX}{module}.lora_B.weight", b, r, b_split))
    return specs


# ---- the HTTP path: WeightSender with megatron sources ------------------------------------------------------

def _meta(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def megatron_source(model: nn.Module, layout: Layout, merged: bool, flavour: str = "hf") -> Source:
    """The base (or merged) model under HF names; each bucket's tensors are made when it goes out (under TP a
    collective: every TP rank must `get` the same names in the same order)."""
    tp = _tp_size()
    wrapped = {f"{name}.weight": m for name, m in lora_modules(model).items()} if merged else {}
    maps = {pm.megatron: pm for pm in param_maps(layout, flavour)}
    params = {}
    groups: list[list[Named]] = []
    owner: dict[str, str] = {}
    for base, p in base_parameters(model):
        pm = maps[base]
        params[base] = p
        for hf_name, shape in _meta_outs(pm.kind, p.shape, pm.hf, layout, 1 if is_expert_module(base) else tp):
            groups.append([(hf_name, _meta(shape, p.dtype))])
            owner[hf_name] = base

    def get(names: Sequence[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for base in dict.fromkeys(owner[n] for n in names):
            pm = maps[base]
            out.update(param_hf_tensors(params[base], pm.kind, pm.hf, wrapped.get(base), layout,
                                        whole=is_expert_module(base)))
        return {n: out[n].contiguous() for n in names}

    adapted = frozenset(h for h, base in owner.items() if base in wrapped) if merged else None
    return Source(groups, get, adapted)


def megatron_adapter_source(model: nn.Module, layout: Layout, flavour: str = "hf") -> Source:
    """The adapter under HF-PEFT names, each lora_A/lora_B pair one group (never split)."""
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
    """`WeightSender` for a megatron policy (`MegatronBackend.model`). Every TP rank constructs it (a collective
    when TP > 1) with the transport on one rank (TP rank 0) and None on the others, and calls `sync()`."""

    def __init__(self, model: nn.Module, layout: Layout, cfg: Any, transport: Any, trainer_group: Any = None,
                 verify: bool = True, flavour: str = "hf"):
        self.layout, self.flavour = layout, flavour
        self._adapter_src: Source | None = None
        mp = model_parallel_group()
        if mp is not None:
            transport = _tp_transport(mp, transport)
            if trainer_group is None:  # the shards differ per TP rank and stage: the skip decision spans them
                trainer_group = mp
        super().__init__(model, cfg, transport, trainer_group, verify)

    def make_adapter_config(self) -> dict[str, Any]:
        return peft_config(self.model, self.cfg.lora, self.cfg.model.path, all_lora_modules(self.model))

    def adapter_named(self) -> list[Named]:
        return [(f"{n}.lora_{w}", getattr(m, f"lora_{w}").weight.detach())
                for n, m in lora_modules(self.model).items() for w in "AB"]

    def merged_source(self) -> Source:
        return across_ranks(megatron_source(self.model, self.layout, True, self.flavour), self.model)

    def base_source(self) -> Source:
        return across_ranks(megatron_source(self.model, self.layout, False, self.flavour), self.model)

    def adapter_source(self) -> Source:
        if self._adapter_src is None:  # the plan (names, shapes) is fixed: one export per push, not two
            self._adapter_src = across_ranks(megatron_adapter_source(self.model, self.layout, self.flavour),
                                              self.model, experts_whole=True)
        return self._adapter_src

    def served_adapter_source(self) -> Source:  # its flavour already names what the engines take
        return self.adapter_source()

    # ---- the fast path's plan (sync/fast/policy.py's PolicyPlan): TP = 1, dense models -------------------------

    def _fast_covered(self) -> None:
        if _tp_size() > 1:
            raise NotImplementedError("tensor parallelism: the trainer's fast path is wired at TP = 1")
        if pp_rank_size()[1] > 1:
            raise NotImplementedError("pipeline parallelism: the trainer's fast path is wired for one stage")
        if self.layout.num_experts:
            raise NotImplementedError("MoE models: expert tensors and adapters go through the HTTP path")

    def fast_adapter_params(self) -> list[nn.Parameter]:
        return list(adapter_parameters(self.model))

    def fast_merge_entries(self) -> list[Entry]:
        self._fast_covered()
        return merge_entries(self.model, self.layout, True, self.flavour)

    def fast_adapter_specs(self) -> list[GatherSpec]:
        self._fast_covered()
        return adapter_specs(self.model, self.layout, self.flavour)


def _tp_transport(tp: WeightUpdateGroup, transport: Any) -> Any:
    """This TP rank's transport: its own, or a `follower` of the TP rank(s) that hold one (every TP rank calls
    this: one MAX all-reduce of [tp] transport kinds). The HTTP sources all-gather the shards, so every TP rank
    holds the whole policy while a push runs: Colocate lets each rank feed the engines beside it; over the
    weight-update group one rank (TP rank 0) broadcasts."""
    kinds = [DistributedTransport.kind, ColocatedTransport.kind]
    mine = getattr(transport, "kind", None)
    if transport is not None and mine not in kinds:
        raise ValueError(f"a {mine!r} transport cannot lead a tensor-parallel push")
    codes = torch.zeros(tp.world_size, dtype=torch.int64, device=tp.device)
    if transport is not None:
        codes[tp.rank] = 1 + kinds.index(str(mine))
    tp.allreduce_max(codes)
    held = {r: kinds[c - 1] for r, c in enumerate(codes.tolist()) if c}
    if len(set(held.values())) > 1 or (len(held) > 1 and DistributedTransport.kind in held.values()):
        raise ValueError(f"TP ranks {sorted(held)} hold transports {sorted(set(held.values()))}: over the weight-"
                         "update group one TP rank (rank 0) sends, the others get None; only colocated transports "
                         "may sit on several TP ranks")
    if transport is None and held:
        return follower(next(iter(held.values())))
    return transport
