"""transformers-5 fused MoE experts <-> the per-expert names checkpoints and SGLang use.

In memory transformers 5 holds a Qwen3-MoE layer's experts fused: `…mlp.experts.gate_up_proj` [E, 2I, H] (each
expert's gate rows, then its up rows) and `…mlp.experts.down_proj` [E, H, I]. Its checkpoints, megatron's
per-expert modules and SGLang's `load_weights` name them one by one: `…mlp.experts.{e}.{gate,up,down}_proj.weight`
[I, H] / [H, I]. Weight sync speaks the per-expert names (what SGLang takes); the reference engine and the
megatron loader map them onto the fused tensors here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def per_expert_views(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A fused expert tensor as its per-expert (name, view) pairs (no copy); any other tensor as itself."""
    m = FUSED.match(name)
    if m is None:
        return [(name, t)]
    prefix, which = m.groups()
    if t.dim() != 3:
        raise ValueError(f"{name}: expected a 3-D [E, …] expert tensor, got {tuple(t.shape)}")
    out = []
    for e in range(t.shape[0]):
        if which == "gate_up_proj":
            gate, up = t[e].chunk(2, dim=0)
            out += [(f"{prefix}.{e}.gate_proj.weight", gate), (f"{prefix}.{e}.up_proj.weight", up)]
        else:
            out.append((f"{prefix}.{e}.down_proj.weight", t[e]))
    return out


def unfuse_hf_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every fused expert tensor of `state` under its per-expert names; other tensors pass through."""
    return {n: v for name, t in state.items() for n, v in per_expert_views(name, t)}


def fused_parent(name: str) -> str | None:
    """The fused parameter a per-expert name lives in (None for any other name)."""
    m = PER_EXPERT.match(name)
    if m is None:
        return None
    prefix, _, part = m.groups()
    return f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"


def fused_slot(name: str, params: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The view of a fused parameter in `params` that the per-expert tensor `name` is (None if it is not one)."""
    parent = fused_parent(name)
    if parent is None or parent not in params:
        return None
    m = PER_EXPERT.match(name)
    assert m is not None
    e, part = int(m.group(2)), m.group(3)
    w = params[parent][e]
    if part == "down_proj":
        return w
    gate, up = w.chunk(2, dim=0)
    return gate if part == "gate_proj" else up


def fuse_hf_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `unfuse_hf_experts`: per-expert names -> the fused `gate_up_proj` / `down_proj`
    (what `Qwen3MoeForCausalLM.load_state_dict` takes)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in state.items():
        m = PER_EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, e, part = m.groups()
        groups.setdefault(prefix, {}).setdefault(part, {})[int(e)] = t
    for prefix, parts in groups.items():
        n = len(parts["down_proj"])
        if any(sorted(parts[p]) != list(range(n)) for p in ("gate_proj", "up_proj", "down_proj")):
            raise KeyError(f"{prefix}: experts are not numbered 0..{n - 1} for every projection")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]], dim=0) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return out
