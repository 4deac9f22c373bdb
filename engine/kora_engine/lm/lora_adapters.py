"""LoRA adapters held by the reference engine, applied per batch row like SGLang's multi-LoRA batches.

An adapter is a set of `(A [r, in], B [out, r], scaling)` per target Linear module, parsed from
HF-PEFT names (`base_model.model.<module>.lora_A.weight`, also `...lora_A.<adapter>.weight` as in an
in-memory PEFT state dict). The engine never wraps its model in PEFT: a forward hook on each
targeted Linear adds `scaling · (x Aᵀ) Bᵀ` for the rows whose request asked for that adapter, so
one batch can mix the base model (`lora_path: null`) and several adapters, and an adapter object
is immutable once built — replacing the one registered under a name (upsert) never changes a
forward that already holds the old object.

Pairs on bare parameters (PEFT `target_parameters`: transformers 5's fused MoE experts and router) are
`param_lora.ParamDelta`s, served per batch row too: the module that owns the parameter runs once per
adapter on that adapter's rows with W + s·ΔW (`param_lora.rows_forward`), as PEFT's ParamWrapper runs it —
also for an nn.Linear's weight named in `target_parameters` (an MoE model's dense-layer MLP).
"""

from __future__ import annotations

import json
import math
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from kora_engine.lm.param_lora import ParamDelta, owns_matrices, resolve_target, rows_forward
from kora_trainer.config.engine_lora_limits import engine_lora_limits
from kora_trainer.wire.gdn_lora import hf_pairs
from kora_trainer.wire.lora_names import split_lora_name


def pair_lora_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Group PEFT tensors into {module: (A [r, in], B [out, r])}; a half pair or a stranger is an error."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        parsed = split_lora_name(name)
        if parsed is None:
            raise ValueError(f"{name} is not a LoRA tensor name (expected <module>.lora_A.weight / .lora_B.weight)")
        module, which = parsed
        halves.setdefault(module, {})[which] = tensor
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, h in halves.items():
        if set(h) != {"A", "B"}:
            missing = ({"A", "B"} - set(h)).pop()
            raise ValueError(f"{module}: lora_{missing} is missing (lora_A and lora_B travel together)")
        a, b = h["A"], h["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair")
        pairs[module] = (a, b)
    return pairs


def _pattern_value(patterns: dict[str, float], module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: a key matches the module name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def module_scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """alpha / r (alpha / sqrt(r) with use_rslora), honouring rank_pattern / alpha_pattern."""
    r = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", rank))
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", r))
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else float(r))


@dataclass(frozen=True)
class LoRAAdapter:
    """One immutable adapter: Linear module -> (A [r, in], B [out, r], scaling), and the parameter-targeted pairs
    by owning module (`params`)."""

    name: str
    source: str  # the PEFT dir, or "__tensor__" / "__distributed__" for adapters that came over the wire
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    config: dict[str, Any] = field(default_factory=dict)
    version: str | None = None
    params: dict[str, tuple[ParamDelta, ...]] = field(default_factory=dict)
    # minted per object, as SGLang mints a lora_id per load: a published version is a new object with a new id
    lora_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def target_modules(self) -> set[str]:
        return {m.rsplit(".", 1)[-1] for m in self.weights}


def validate_config(config: dict[str, Any]) -> None:
    """The adapter kinds the engine refuses (SGLang's `validate_new_adapter` refuses the same)."""
    if config.get("use_dora"):
        raise ValueError("DoRA adapters are not supported.")
    if config.get("peft_type", "LORA").upper() != "LORA":
        raise ValueError(f"only LoRA adapters are supported, got peft_type {config.get('peft_type')}")


def build_adapter(name: str, source: str, config: dict[str, Any], named: Iterable[tuple[str, torch.Tensor]],
                  model: nn.Module, dtype: torch.dtype, device: torch.device,
                  max_rank: int | None = None, version: str | None = None,
                  gate_adapters: bool | None = None) -> LoRAAdapter:
    """Check the tensors against the model and copy them to the engine's device/dtype. SGLang's fused GDN names
    are read back onto the HF model's modules (wire/gdn_lora.py); `gate_adapters`: whether this engine, as the build
    it stands for, carries GDN b/a gate adapters (default: the stock build's answer, config/engine_lora_limits.py)."""
    validate_config(config)
    pairs = pair_lora_tensors(named)
    if not pairs:
        raise ValueError(f"adapter {name} holds no LoRA tensors")
    modules = dict(model.named_modules())
    carries = engine_lora_limits().gdn_gate_adapters if gate_adapters is None else gate_adapters
    try:
        pairs, stacked = hf_pairs(pairs, lambda m: _linear_width(modules, m), carries)
    except ValueError as e:
        raise ValueError(f"adapter {name}: {e}") from None
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    params: dict[str, list[ParamDelta]] = {}
    rank = 0
    for module, (a, b) in pairs.items():
        try:
            target = resolve_target(modules, module, a, b, config)
        except ValueError as e:
            raise ValueError(f"adapter {name}: {e}") from None
        r = target.rank(a) // stacked.get(module, 1)  # a stack of pieces of rank r each (hf_pairs)
        rank = max(rank, r)
        a_, b_ = a.to(device=device, dtype=dtype).clone(), b.to(device=device, dtype=dtype).clone()
        scaling = module_scaling(config, target.pattern_key, r)
        if target.linear:
            weights[target.module] = (a_, b_, scaling)
        else:
            params.setdefault(target.module, []).append(ParamDelta(target, a_, b_, scaling))
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"LoRA adapter {name} with rank {rank} exceeds max_lora_rank={max_rank}. "
                         "Restart the server with a larger --max-lora-rank.")
    return LoRAAdapter(name, source, rank, weights, dict(config), version,
                       {m: tuple(d) for m, d in params.items()})


def _linear_width(modules: dict[str, nn.Module], module: str) -> int | None:
    m = modules.get(module)
    return m.out_features if isinstance(m, nn.Linear) else None


def read_peft_dir(path: str | Path) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """adapter_config.json + adapter_model.safetensors (or .bin) of a PEFT save_pretrained directory."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"LoRA adapter path {path} is not a directory (the hf engine loads local PEFT dirs only)")
    config = json.loads((root / "adapter_config.json").read_text())
    st = root / "adapter_model.safetensors"
    if st.exists():
        tensors = load_file(str(st))
    else:
        tensors = torch.load(root / "adapter_model.bin", map_location="cpu", weights_only=True)
    return config, list(tensors.items())


class MultiLoRAHooks:
    """Forward hooks that add each row's adapter delta to the targeted Linear outputs, and a forward of each
    module owning 2-D / 3-D parameters (MoE experts, router) that runs it per adapter's rows (`rows_forward`).

    `rows(...)` sets, for the forwards inside it, which adapter each batch row uses
    (None = base). A hook sits on every Linear from the start, and every such module's forward is
    wrapped from the start, so loading an adapter never touches the model while another thread
    runs a forward; without adapters a hook / wrapper returns at once.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._local = threading.local()
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self._make_hook(name))
            if owns_matrices(module):
                module.forward = self._make_forward(name, module, module.forward)

    @contextmanager
    def rows(self, per_row: list[LoRAAdapter | None], device: torch.device) -> Iterator[None]:
        groups: list[tuple[LoRAAdapter, torch.Tensor | None]] = []
        distinct = {id(a): a for a in per_row if a is not None}
        for adapter in distinct.values():
            idx = [i for i, a in enumerate(per_row) if a is adapter]
            # None = every row: skip the gather/scatter
            groups.append((adapter, None if len(idx) == len(per_row) else torch.tensor(idx, device=device)))
        self._local.groups, self._local.batch = groups, len(per_row)
        try:
            yield
        finally:
            self._local.groups = []

    def _make_hook(self, module: str) -> Callable[[nn.Module, tuple[Any, ...], torch.Tensor], torch.Tensor]:
        def hook(_mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            groups = getattr(self._local, "groups", None)
            if not groups:
                return out
            x = args[0]  # [B, T, in]
            for adapter, idx in groups:
                w = adapter.weights.get(module)
                if w is None:
                    continue
                a, b, scaling = w
                if idx is None:
                    out = out + scaling * ((x @ a.T) @ b.T)  # [B, T, out]
                else:
                    delta = scaling * ((x.index_select(0, idx) @ a.T) @ b.T)  # [b, T, out]
                    out = out.index_add(0, idx, delta)
            return out

        return hook

    def _make_forward(self, module: str, owner: nn.Module, forward: Any) -> Any:
        def adapted(*args: Any, **kwargs: Any) -> Any:
            groups = [(adapter.params[module], idx) for adapter, idx in getattr(self._local, "groups", None) or ()
                      if module in adapter.params]
            if not groups:
                return forward(*args, **kwargs)
            return rows_forward(owner, forward, groups, self._local.batch, args, kwargs)

        return adapted
