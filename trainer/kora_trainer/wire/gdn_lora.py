"""GDN adapters on the wire: HF-PEFT names (what the trainer trains and exports) <-> the names SGLang's LoRA loader
takes for its fused GDN modules (what an Adapter-mode push carries), exactly, at the adapter's own rank.

SGLang 0.5.23 serves a Qwen3.5 GDN layer's projections as `in_proj_qkvz` (q | k | v | z rows) and `in_proj_ba`
(b | a rows) (models/qwen3_5.py:1710 packed_modules_mapping, :1987 stacked_params_mapping). Its loader
(lora/lora.py:412 `_normalize_in_proj_qkvz`) stacks an adapter given as the four pieces `in_proj_q`, `in_proj_k`,
`in_proj_v`, `in_proj_z` — lora_A blocks stacked [4r, hidden], lora_B rows concatenated — or takes a pre-fused
`in_proj_qkvz` whose one lora_A it repeats 4x. It does NOT read HF's two-way `in_proj_qkv` + `in_proj_z` layout
(sgl-project/sglang #30168: a crash at start; the fix, #30189, is open; #30499 added it on sglang-miles only), and
its target-module check (lora_manager.py:860, mem_pool.py:238 `can_support`) wants `in_proj_qkvz` in the adapter
config. So a push names:
- `in_proj_qkv` (A [r, h], B [2k+v, r]) as `in_proj_q` / `in_proj_k` / `in_proj_v`, each with that A and its rows of
  B ([k | k | v]; HF splits the conv output so, modeling_qwen3_5.py `Qwen3_5GatedDeltaNet.forward`); `in_proj_z` as
  itself: the four pieces SGLang stacks into `in_proj_qkvz`, which equals HF's two adapters row for row;
- `in_proj_b` / `in_proj_a` as themselves (#30499's `_normalize_in_proj_ba` concatenates them) where the build
  carries gate adapters, else not at all (they are pinned to zero in training: lora/gdn.py);
- in the config, `in_proj_qkvz` (and `in_proj_ba`) for the HF leaves.

The reference engine runs the HF model, so it maps a push back (`hf_pairs`): q/k/v pieces -> one `in_proj_qkv`
pair of rank 3r (lora_A blocks stacked, lora_B block-diagonal: the same product), a fused `in_proj_qkvz` /
`in_proj_ba` (one lora_A shared by its slices, SGLang's pre-fused form) -> its HF modules' row slices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kora_trainer.lora.gdn import GATE_LEAVES, IN_PROJ_QKV, IN_PROJ_Z, SGLANG_BA, SGLANG_QKVZ
from kora_trainer.wire.lora_names import split_lora_name

Named = tuple[str, torch.Tensor]
Pair = tuple[Named, Named]
QKV_PIECES = ("in_proj_q", "in_proj_k", "in_proj_v")
GATE_REFUSED = (
    "{modules}: this engine build carries no LoRA on GDN gate projections (in_proj_b / in_proj_a; SGLang 0.5.23 "
    "has no in_proj_ba adapter: models/qwen3_5.py supported_lora_modules, sgl-project/sglang #30499) and would serve "
    "the base gates. Train in Adapter mode with the gate rows pinned (the trainer's default for this build), or use "
    "lora.syncMode Merge")


def _module(name: str) -> str:
    parsed = split_lora_name(name)
    if parsed is None:
        raise ValueError(f"{name} is not a LoRA tensor name")
    return parsed[0]


def _split(module: str) -> tuple[str, str]:
    parent, _, leaf = module.rpartition(".")
    return parent, leaf


def _renamed(name: str, module: str, new_module: str) -> str:
    # the module sits between PEFT's prefix and `.lora_A...`: replace that span only
    head, _, tail = name.rpartition(f"{module}.lora_")
    return f"{head}{new_module}.lora_{tail}"


def to_sglang_pairs(pairs: Sequence[Pair], gate_adapters: bool) -> list[Pair]:
    """The trainer's HF-PEFT pairs as SGLang takes them (see the module docstring); pairs of other modules as they
    are. `gate_adapters`: the build carries b/a adapters (config/engine_lora_limits.py)."""
    out_rows = {_module(a): tb.shape[0] for (a, _), (_, tb) in pairs}
    out: list[Pair] = []
    for (a_name, a), (b_name, b) in pairs:
        module = _module(a_name)
        parent, leaf = _split(module)
        if leaf in GATE_LEAVES and not gate_adapters:
            continue
        if leaf != IN_PROJ_QKV:
            out.append(((a_name, a), (b_name, b)))
            continue
        z_rows = out_rows.get(f"{parent}.{IN_PROJ_Z}")
        if z_rows is None:
            raise ValueError(f"{module}: its in_proj_z adapter is missing (SGLang stacks q, k, v and z together: "
                             "lora.targetModules in_proj adapts all four)")
        k = (b.shape[0] - z_rows) // 2  # rows [k | k | v], v = in_proj_z's rows
        for piece, rows in zip(QKV_PIECES, (slice(0, k), slice(k, 2 * k), slice(2 * k, None)), strict=True):
            new = f"{parent}.{piece}"
            out.append(((_renamed(a_name, module, new), a), (_renamed(b_name, module, new), b[rows].contiguous())))
    return out


def to_sglang_config(config: dict[str, Any], gate_adapters: bool) -> dict[str, Any]:
    """adapter_config.json for the pushed adapter: target_modules under SGLang's fused GDN names."""
    targets: list[str] = []
    for t in config.get("target_modules") or []:
        head, _, leaf = t.rpartition(".")
        if leaf in (IN_PROJ_QKV, IN_PROJ_Z):
            leaf = SGLANG_QKVZ
        elif leaf in GATE_LEAVES:
            if not gate_adapters:
                continue
            leaf = SGLANG_BA
        name = f"{head}.{leaf}" if head else leaf
        if name not in targets:
            targets.append(name)
    return {**config, "target_modules": targets}


# ---- the engine's side ------------------------------------------------------------------------------------------

Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _slices(module: str, a: torch.Tensor, b: torch.Tensor, parts: Sequence[str],
            out_features: Callable[[str], int | None]) -> Pairs:
    """A pre-fused pair (one lora_A for every slice) -> each HF module's (A, its rows of B)."""
    parent, _ = _split(module)
    sizes = [out_features(f"{parent}.{p}") for p in parts]
    if any(s is None for s in sizes) or sum(s for s in sizes if s is not None) != b.shape[0]:
        raise ValueError(f"{module}: lora_B {tuple(b.shape)} does not split over this model's {', '.join(parts)}")
    out: Pairs = {}
    start = 0
    for p, n in zip(parts, sizes, strict=True):
        assert n is not None
        out[f"{parent}.{p}"] = (a, b[start:start + n])
        start += n
    return out


def hf_pairs(pairs: Pairs, out_features: Callable[[str], int | None], gate_adapters: bool
             ) -> tuple[Pairs, dict[str, int]]:
    """SGLang-named GDN pairs -> pairs on the HF model's modules; other pairs as they are. Also returns, per module
    made of stacked pieces, how many (its rank is lora_A's rows / that). `out_features(module)`: the model's Linear
    width, None when it has no such module. A gate pair that would change the policy is refused where the build
    carries none (SGLang would serve the base gates: GATE_REFUSED); an all-zero one adds nothing and is dropped."""
    out: Pairs = {}
    stacked: dict[str, int] = {}
    for module, (a, b) in pairs.items():
        parent, leaf = _split(module)
        if leaf == SGLANG_QKVZ:
            out.update(_slices(module, a, b, (IN_PROJ_QKV, IN_PROJ_Z), out_features))
        elif leaf == SGLANG_BA:
            out.update(_slices(module, a, b, GATE_LEAVES, out_features))
        elif leaf == QKV_PIECES[0]:
            pieces = [pairs.get(f"{parent}.{p}") for p in QKV_PIECES]
            if any(p is None for p in pieces):
                raise ValueError(f"{module}: in_proj_q, in_proj_k and in_proj_v travel together (SGLang stacks them)")
            a_s = [p[0] for p in pieces if p is not None]
            b_s = [p[1] for p in pieces if p is not None]
            qkv = f"{parent}.{IN_PROJ_QKV}"
            out[qkv] = (torch.cat(a_s, dim=0), torch.block_diag(*b_s))  # [3r, h], [2k+v, 3r]: sum of B_i·A_i rows
            stacked[qkv] = len(QKV_PIECES)
        elif leaf not in QKV_PIECES[1:]:
            out[module] = (a, b)
    gates = [m for m in out if _split(m)[1] in GATE_LEAVES]
    if not gate_adapters and gates:
        live = [m for m in gates if bool(out[m][1].any())]
        if live:
            raise ValueError(GATE_REFUSED.format(modules=", ".join(live)))
        for m in gates:
            del out[m]
    return out, stacked
