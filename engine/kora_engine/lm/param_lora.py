"""LoRA on bare parameters (PEFT's `target_parameters`, its ParamWrapper) in the reference engine.

transformers 5 keeps a Qwen3-MoE layer's experts as 3-D parameters (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]) and its router as a bare `mlp.gate.weight` [E, H]: no nn.Linear to hook.
PEFT adapts such a parameter W by running the owning module with W + s·ΔW:
- 2-D W [out, in]: ΔW = B·A, A [r, in], B [out, r];
- 3-D W [E, out, in]: PEFT's grouped layout, lora_A [E·r, in] (the experts' A_e stacked, expert-major rows) and
  lora_B [out, r·E] (column j·E + e = column j of B_e); ΔW[e] = B_e·A_e, formed with one `baddbmm` as peft 0.21
  does (`_LoraFactorsProxy`). Experts stored [E, in, out] (transformers' `is_transposed`) get the transpose.

Names: PEFT nests the wrappers of two parameters of one module in the module's parameter order, the last one
outermost, so `…mlp.experts.base_layer.lora_A.weight` is gate_up_proj's and `…mlp.experts.lora_A.weight`
down_proj's (when both are targeted). `resolve_target` reads a key back to its parameter with the adapter
config's `target_parameters`, or, without a config (a lora_merge push), by which parameter the factors fit.

Serving (`rows_forward`): the owning module runs once per adapter in the batch, on that adapter's rows (every
tensor argument split on dim 0: the module's tokens, B·T of them or B), with the adapter's effective
parameters swapped in for that call, and once on the remaining rows with the base ones; the outputs are put back
in row order. Every token of an MoE block is routed and computed on its own, so this equals one PEFT forward
per adapter, and one batch can still mix the base and several adapters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kora_trainer.lora.grouped import grouped_delta

_BASE = ".base_layer"

ROUTER_MERGE_REFUSED = (
    "{module}: router LoRA cannot be folded by weight_update_mode lora_merge (SPEC rule 5: router in "
    "targetModules requires Adapter mode; merge folding handles linear layers and fused experts only). "
    "Use lora.syncMode Adapter to serve a router adapter.")


@dataclass(frozen=True)
class ParamTarget:
    """The model parameter one lora_A / lora_B pair adapts."""

    module: str  # the module that owns the parameter (model.layers.0.mlp.experts)
    param: str  # its name on that module (gate_up_proj, down_proj, weight)
    experts: int  # E of a 3-D [E, ·, ·] parameter; 0 for a 2-D one
    transposed: bool  # 3-D stored [E, in, out]
    linear: bool  # an nn.Linear in target_modules: served by the engine's Linear hooks (x·Aᵀ·Bᵀ)
    router: bool  # an MoE router's weight (refused by lora_merge: SPEC rule 5)
    pattern_key: str  # the name rank_pattern / alpha_pattern match (PEFT's current_key)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}"

    def rank(self, a: torch.Tensor) -> int:
        return a.shape[0] // max(self.experts, 1)


def _listed(owner: nn.Module, path: str, targets: Sequence[str]) -> list[str]:
    """The owner's parameters that `target_parameters` names, in PEFT's nesting order (the module's own)."""
    out = []
    for p, _ in owner.named_parameters(recurse=False):
        key = f"{path}.{p}"
        if any(key == t or key.endswith(f".{t}") for t in targets):
            out.append(p)
    return out


def _out_in(w: torch.Tensor, transposed: bool) -> tuple[int, int]:
    if w.dim() == 2:
        return w.shape[0], w.shape[1]
    return (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])


def _fits(w: torch.Tensor, transposed: bool, a: torch.Tensor, b: torch.Tensor) -> bool:
    if w.dim() not in (2, 3):
        return False
    out_f, in_f = _out_in(w, transposed)
    groups = w.shape[0] if w.dim() == 3 else 1
    return (a.shape[1], b.shape[0]) == (in_f, out_f) and a.shape[0] % groups == 0


def _is_router(modules: Mapping[str, nn.Module], path: str, owner: nn.Module) -> bool:
    parent, _, leaf = path.rpartition(".")
    return "router" in type(owner).__name__.lower() or (leaf in ("gate", "router")
                                                        and hasattr(modules.get(parent), "experts"))


def resolve_target(modules: Mapping[str, nn.Module], key: str, a: torch.Tensor, b: torch.Tensor,
                   config: Mapping[str, Any] | None) -> ParamTarget:
    """The parameter that the pair under PEFT module key `key` (`split_lora_name`'s module) adapts."""
    path, depth = key.replace(_BASE, ""), key.count(_BASE)
    owner = modules.get(path)
    if owner is None:
        raise ValueError(f"{key}: the model has no module {path}")
    transposed = bool(getattr(owner, "is_transposed", False))
    listed = _listed(owner, path, (config or {}).get("target_parameters") or [])
    if listed:
        if depth >= len(listed):
            raise ValueError(f"{key}: target_parameters name {len(listed)} parameter(s) of {path}, "
                             f"the key is {depth} wrapper(s) deep")
        param, by_param = listed[len(listed) - 1 - depth], True
    elif isinstance(owner, nn.Linear) and depth == 0:
        param, by_param = "weight", False  # target_modules
    else:
        fits = [p for p, w in owner.named_parameters(recurse=False) if _fits(w, transposed, a, b)]
        if len(fits) != 1:
            what = "no parameter" if not fits else f"more than one parameter ({', '.join(fits)})"
            raise ValueError(f"{key}: {what} of {path} fits lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}; "
                             "name it in the adapter config's target_parameters")
        param, by_param = fits[0], True
    w = owner.get_parameter(param)
    if not _fits(w, transposed, a, b):
        out_f, in_f = _out_in(w, transposed)
        e = f"{w.shape[0]}·" if w.dim() == 3 else ""
        raise ValueError(f"{key}: {path}.{param} {tuple(w.shape)} expects lora_A [{e}r, {in_f}] and "
                         f"lora_B [{out_f}, {e}r], got {tuple(a.shape)} and {tuple(b.shape)}")
    return ParamTarget(path, param, w.shape[0] if w.dim() == 3 else 0, transposed and w.dim() == 3,
                       isinstance(owner, nn.Linear) and not by_param, _is_router(modules, path, owner),
                       f"{path}.{param}" if by_param else path)


def _expert_factors(a: torch.Tensor, b: torch.Tensor, experts: int,
                    transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(lhs, rhs) with ΔW = lhs @ rhs per expert, as peft's `ParamWrapper.get_delta_factors`."""
    a3 = a.reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b3 = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # [E, out, r]
    return (a3.transpose(-2, -1), b3.transpose(-2, -1)) if transposed else (b3, a3)


@dataclass(frozen=True)
class ParamDelta:
    """One adapter's pair on one parameter (on the engine's device and dtype)."""

    target: ParamTarget
    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def effective(self, w: torch.Tensor) -> torch.Tensor:
        """W + s·ΔW, formed as PEFT's ParamWrapper forms it for a single adapter."""
        if not self.target.experts:
            return w + (self.b @ self.a) * self.scaling
        lhs, rhs = _expert_factors(self.a, self.b, self.target.experts, self.target.transposed)
        return torch.baddbmm(w, lhs, rhs, alpha=self.scaling)


def folded(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, target: ParamTarget,
           work: torch.dtype) -> torch.Tensor:
    """W0 + s·ΔW accumulated in `work` and rounded to W0's dtype once (lora_merge): B·A for a 2-D weight,
    B_e·A_e into expert e of a 3-D one."""
    a_, b_ = a.to(device=w0.device, dtype=work), b.to(device=w0.device, dtype=work)
    delta = grouped_delta(a_, b_, target.experts) if target.experts else b_ @ a_
    if target.transposed:
        delta = delta.transpose(-2, -1)
    return (w0.to(work) + scaling * delta).to(w0.dtype)


def owns_matrices(module: nn.Module) -> bool:
    """A module with own 2-D / 3-D parameters, which `target_parameters` may name (an nn.Linear's weight too)."""
    return any(p.dim() in (2, 3) for p in module.parameters(recurse=False))


@contextmanager
def effective_parameters(module: nn.Module, deltas: Sequence[ParamDelta]) -> Iterator[None]:
    """The module's adapted parameters replaced by W + s·ΔW for the calls inside; the originals put back."""
    params: dict[str, Any] = module._parameters  # a plain swap, as torch.func.functional_call does
    saved = {d.target.param: params[d.target.param] for d in deltas}
    try:
        for d in deltas:
            params[d.target.param] = d.effective(saved[d.target.param])
        yield
    finally:
        params.update(saved)


def _token_index(rows: torch.Tensor, per_row: int) -> torch.Tensor:
    return (rows[:, None] * per_row + torch.arange(per_row, device=rows.device)).reshape(-1)


def _take(value: Any, index: torch.Tensor, n: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
        return value.index_select(0, index)
    return value


def _put_back(pieces: list[tuple[torch.Tensor, Any]], n: int) -> Any:
    first = pieces[0][1]
    if isinstance(first, torch.Tensor):
        full = first.new_empty((n, *first.shape[1:]))
        for index, out in pieces:
            full.index_copy_(0, index, out)
        return full
    if isinstance(first, tuple | list):
        return type(first)(_put_back([(i, out[k]) for i, out in pieces], n) for k in range(len(first)))
    raise TypeError(f"cannot split a {type(first).__name__} output by batch rows")


def rows_forward(module: nn.Module, forward: Callable[..., Any],
                 groups: Sequence[tuple[Sequence[ParamDelta], torch.Tensor | None]], batch: int,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`forward` with each group's effective parameters on that group's batch rows (None = every row), the base
    parameters on the rest. Tensor arguments hold the module's tokens on dim 0, `batch` rows of them."""
    if len(groups) == 1 and groups[0][1] is None:
        with effective_parameters(module, groups[0][0]):
            return forward(*args, **kwargs)
    lead = next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
    n = lead.shape[0]
    if n % batch:
        raise RuntimeError(f"{type(module).__name__} got {n} tokens for {batch} batch rows")
    used = torch.zeros(batch, dtype=torch.bool, device=lead.device)
    calls: list[tuple[Sequence[ParamDelta], torch.Tensor]] = []
    for deltas, rows in groups:
        rows = torch.arange(batch, device=lead.device) if rows is None else rows
        used[rows] = True
        calls.append((deltas, rows))
    rest = (~used).nonzero().reshape(-1)
    if rest.numel():
        calls.append(((), rest))
    pieces = []
    for deltas, rows in calls:
        index = _token_index(rows, n // batch)
        with effective_parameters(module, deltas):
            out = forward(*(_take(v, index, n) for v in args), **{k: _take(v, index, n) for k, v in kwargs.items()})
        pieces.append((index, out))
    return _put_back(pieces, n)
