"""Read an HF-PEFT adapter directory and pair each lora_A/lora_B with its base tensor.

Key forms handled (PEFT 0.21 save format, prefix `base_model.model.`):
- `<module>.lora_A.weight` / `.lora_B.weight` → base `<module>.weight` (a 2-D Linear).
- grouped experts via `target_parameters` (PEFT's ParamWrapper): base `<module>.<param>` is 3-D
  [E, X, Y]; lora_A is [E·r, in] (rows expert-major), lora_B is [out, r·E] (columns rank-major).
  Several target parameters on one module nest: the last one in `target_parameters` is the outer
  wrapper (`<module>.lora_A`), earlier ones sit under `.base_layer` once per later parameter.
- the same fused-expert adapter against a checkpoint that stores experts one by one (transformers 5
  fuses `experts.{e}.gate_proj/up_proj` into `experts.gate_up_proj` [E, 2I, H] when it loads, and
  splits them again when it saves): each expert's B·A is cut into its per-expert 2-D weights.
Anything that does not pair with a base tensor is a hard error naming it — a silently dropped
adapter tensor is a policy nobody trained.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kora_trainer.checkpoint.safetensors_io import read_array, read_header

PREFIX = "base_model.model."
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
DIFFUSERS_METADATA = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY: the peft config, per component
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


class AdapterError(ValueError):
    """The adapter cannot be merged as it is; the message names the tensor and the fix."""


@dataclass(frozen=True)
class LoRAPair:
    base_name: str
    a: np.ndarray  # fp32 [r, in] (2-D) or [E·r, in] (grouped experts)
    b: np.ndarray  # fp32 [out, r] or [out, r·E]
    scaling: float


def diffusers_component(adapter_dir: Path) -> str | None:
    """The pipeline component a diffusers LoRA file adapts (`transformer` for a diffusion job's export: its tensors
    are `transformer.<module>.lora_A.weight`, its peft config the file's `lora_adapter_metadata`), or None for an
    HF-PEFT adapter directory."""
    weights = adapter_dir / DIFFUSERS_WEIGHTS
    if not weights.exists() or (adapter_dir / "adapter_config.json").exists():
        return None
    names = read_header(weights).entries
    components = {name.split(".", 1)[0] for name in names}
    if len(components) != 1:
        raise AdapterError(f"{weights}: adapts {sorted(components)}; kora merge folds one component's adapter "
                           "(the transformer of a diffusion job's export)")
    return components.pop()


def _diffusers_adapter(adapter_dir: Path, component: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A diffusers LoRA file as (peft config, tensors) under the component's own module names."""
    weights = adapter_dir / DIFFUSERS_WEIGHTS
    header = read_header(weights)
    raw = (header.metadata or {}).get(DIFFUSERS_METADATA)
    if raw is None:
        raise AdapterError(f"{weights}: no {DIFFUSERS_METADATA} in its metadata, so its rank and alpha are unknown "
                           "(save it with diffusers' save_lora_weights and transformer_lora_adapter_metadata)")
    prefix = f"{component}."
    config = {k.removeprefix(prefix): v for k, v in json.loads(raw).items()}
    with weights.open("rb") as f:
        tensors = {PREFIX + name.removeprefix(prefix): to_float32(read_array(f, e), e.dtype)
                   for name, e in header.entries.items()}
    return config, tensors


def load_adapter(adapter_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """adapter_config.json and every adapter tensor as fp32 numpy arrays (adapters are small); a diffusers LoRA
    file (`diffusers_component`) the same way, its names made PEFT's."""
    cfg_path = adapter_dir / "adapter_config.json"
    weights = adapter_dir / "adapter_model.safetensors"
    component = diffusers_component(adapter_dir)
    if component is not None:
        from_diffusers = _diffusers_adapter(adapter_dir, component)
        _check_plain_lora(from_diffusers[0], adapter_dir / DIFFUSERS_WEIGHTS)
        return from_diffusers
    if not cfg_path.exists() or not weights.exists():
        raise AdapterError(
            f"{adapter_dir}: expected adapter_config.json and adapter_model.safetensors "
            "(an HF-PEFT adapter directory, e.g. a kora checkpoint's lora_adapter/), or diffusers' "
            f"{DIFFUSERS_WEIGHTS}"
        )
    config: dict[str, Any] = json.loads(cfg_path.read_text())
    _check_plain_lora(config, cfg_path)
    header = read_header(weights)
    with weights.open("rb") as f:
        tensors = {name: to_float32(read_array(f, e), e.dtype) for name, e in header.entries.items()}
    return config, tensors


def _check_plain_lora(config: dict[str, Any], cfg_path: Path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type {config.get('peft_type')!r}; kora merge folds LoRA adapters only")
    if config.get("use_dora"):
        raise AdapterError(f"{cfg_path}: DoRA adapters are not plain low-rank updates; merge them with peft")


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    alpha = float(config.get("lora_alpha", 8))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", module):
            alpha = float(value)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _fits(shape: tuple[int, ...], a: np.ndarray, b: np.ndarray) -> bool:
    """Can lora_A [E·r, in] / lora_B [out, r·E] fold into a 3-D [E, X, Y] base (either layout)?"""
    if len(shape) != 3 or a.shape[0] % shape[0] or b.shape[1] != a.shape[0]:
        return False
    return sorted(shape[1:]) == sorted((b.shape[0], a.shape[1]))


def _param_wrapper_target(
    config: dict[str, Any], module: str, a: np.ndarray, b: np.ndarray, base_shapes: dict[str, tuple[int, ...]]
) -> str | None:
    """Base tensor name for a ParamWrapper key (`module` may end in .base_layer repeats).

    peft's saved target_parameters order does not follow the wrappers' nesting order, so the
    parameter is chosen by shape among this module's targets; a tie is reported, not guessed."""
    while module.endswith(".base_layer"):
        module = module[: -len(".base_layer")]
    names = []
    for p in config.get("target_parameters") or []:
        owner, _, param = p.rpartition(".")
        if (module == owner or module.endswith("." + owner)) and f"{module}.{param}" in base_shapes:
            names.append(f"{module}.{param}")
    fitting = [n for n in names if _fits(base_shapes[n], a, b)]
    if len(fitting) > 1:
        raise AdapterError(f"{module}: lora_A {a.shape} / lora_B {b.shape} fit several target parameters "
                           f"({', '.join(fitting)}); kora merge cannot tell which one this adapter trained")
    return fitting[0] if fitting else None


# transformers 5's fused expert parameters -> the per-expert Linear names a saved checkpoint holds, in
# the order they are concatenated along the fused tensor's rows ([E, out, in]: gate rows, then up rows)
_PER_EXPERT = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}


def _per_expert_pairs(
    config: dict[str, Any], module: str, a: np.ndarray, b: np.ndarray, base_shapes: dict[str, tuple[int, ...]]
) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """A fused-expert adapter on `module` (e.g. `model.layers.3.mlp.experts`) folded into per-expert
    weights `module.{e}.<part>.weight`: per-expert-weight name -> (A', B') with B'·A' = that weight's
    slice of expert e's update. None when no target parameter of the module maps that way."""
    while module.endswith(".base_layer"):
        module = module[: -len(".base_layer")]
    found = []
    for p in config.get("target_parameters") or []:
        owner, _, param = p.rpartition(".")
        if not (module == owner or module.endswith("." + owner)):
            continue
        for parts in _PER_EXPERT.get(param, ()):
            experts = 0
            while all(f"{module}.{experts}.{part}.weight" in base_shapes for part in parts):
                experts += 1
            if experts == 0 or a.shape[0] % experts or b.shape[1] != a.shape[0]:
                continue
            shapes = [base_shapes[f"{module}.0.{part}.weight"] for part in parts]  # [rows_i, in] each
            fused = (sum(sh[0] for sh in shapes), shapes[0][1])  # the fused expert's [out, in]
            if (b.shape[0], a.shape[1]) == fused:
                transpose = False
            elif (a.shape[1], b.shape[0]) == fused:
                transpose = True  # PEFT saw the fused tensor as [E, in, out]
            else:
                continue
            found.append((parts, experts, shapes, transpose))
    if not found:
        return None
    if len(found) > 1:
        raise AdapterError(f"{module}: lora_A {a.shape} / lora_B {b.shape} fit several per-expert layouts; "
                           "kora merge cannot tell which one this adapter trained")
    parts, experts, shapes, transpose = found[0]
    rank = a.shape[0] // experts
    a3 = a.reshape(experts, rank, a.shape[1])  # [E, r, in]
    b3 = b.reshape(b.shape[0], rank, experts).transpose(2, 0, 1)  # [E, out, r]
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for e in range(experts):
        # the expert's update as up·down with up [fused_out, r], down [r, fused_in]
        up, down = (a3[e].T, b3[e].T) if transpose else (b3[e], a3[e])
        row = 0
        for part, shape in zip(parts, shapes, strict=True):
            out[f"{module}.{e}.{part}.weight"] = (np.ascontiguousarray(down),
                                                  np.ascontiguousarray(up[row:row + shape[0]]))
            row += shape[0]
    return out


def pair_with_base(
    config: dict[str, Any], tensors: dict[str, np.ndarray], base_shapes: dict[str, tuple[int, ...]]
) -> dict[str, LoRAPair]:
    """Base tensor name -> its LoRA pair. Raises AdapterError on anything unpaired."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key.removeprefix(PREFIX))
        if not m:
            raise AdapterError(
                f"adapter tensor {key} is not a lora_A/lora_B weight (embedding LoRA, "
                "modules_to_save and biases are not supported by kora merge)"
            )
        halves.setdefault(m["module"], {})[m["which"]] = tensor
    base_names = set(base_shapes)
    pairs: dict[str, LoRAPair] = {}
    for module, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"adapter tensor {PREFIX}{module}.lora_{next(iter(ab))}.weight has no {missing} partner")
        target = (
            f"{module}.weight"
            if f"{module}.weight" in base_names
            else _param_wrapper_target(config, module, ab["A"], ab["B"], base_shapes)
        )
        if target is None:
            split = _per_expert_pairs(config, module, ab["A"], ab["B"], base_shapes)
            if split is not None:
                for name, (a_e, b_e) in split.items():
                    pairs[name] = LoRAPair(name, a_e, b_e, _scaling(config, module, a_e.shape[0]))
                continue
            raise AdapterError(
                f"adapter tensor {PREFIX}{module}.lora_A.weight has no base partner: neither "
                f"{module}.weight nor a target_parameters entry exists in the base checkpoint "
                "(is --base the model this adapter was trained on?)"
            )
        a, b = ab["A"], ab["B"]
        shape = base_shapes[target]
        experts = shape[0] if len(shape) == 3 else 1
        if a.shape[0] % experts or b.shape[1] != a.shape[0]:
            raise AdapterError(
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit {target} {shape}"
            )
        rank = a.shape[0] // experts
        pairs[target] = LoRAPair(target, a, b, _scaling(config, module, rank))
    return pairs


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # bf16 is the top half of an fp32
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def from_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """Round once to the checkpoint's dtype (bf16: round-to-nearest-even, as torch does)."""
    if dtype == "BF16":
        bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
        rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
        nan = np.isnan(array)
        if nan.any():  # keep NaNs NaN (rounding could carry into the exponent)
            rounded[nan] = (bits[nan] >> 16) | np.uint32(0x40)
        return rounded.astype(np.uint16)
    if dtype in ("F32", "F16", "F64"):
        return array.astype({"F32": np.float32, "F16": np.float16, "F64": np.float64}[dtype])
    raise AdapterError(f"cannot fold into a {dtype} tensor (kora merge folds into bf16/fp16/fp32/fp64 weights)")


def fold(weight: np.ndarray, dtype: str, pair: LoRAPair) -> np.ndarray:
    """W + s·B·A in fp32, rounded once to W's dtype. Grouped experts are folded one expert at a
    time so the fp32 temporaries stay the size of one expert."""
    a, b = pair.a, pair.b
    if weight.ndim == 2:
        out_f, in_f = weight.shape
        if (b.shape[0], a.shape[1]) != (out_f, in_f):
            raise AdapterError(
                f"{pair.base_name}: B·A is {(b.shape[0], a.shape[1])} but the base is {tuple(weight.shape)}"
            )
        w = to_float32(weight, dtype)  # [out, in]
        w += np.float32(pair.scaling) * (b @ a)  # [out, r] @ [r, in]
        return from_float32(w, dtype)
    experts, x, y = weight.shape
    rank = a.shape[0] // experts
    a3 = a.reshape(experts, rank, a.shape[1])  # [E, r, in]
    b3 = b.reshape(b.shape[0], rank, experts).transpose(2, 0, 1)  # [E, out, r]
    out_f, in_f = b3.shape[1], a3.shape[2]
    if (x, y) == (out_f, in_f):
        transpose = False  # experts stored [E, out, in] (also chosen when square: PEFT's default layout)
    elif (x, y) == (in_f, out_f):
        transpose = True  # experts stored [E, in, out]
    else:
        raise AdapterError(f"{pair.base_name}: expert B·A is {(out_f, in_f)} but the base experts are {(x, y)}")
    merged = np.empty_like(weight)
    for e in range(experts):
        delta = b3[e] @ a3[e]  # [out, in]
        w = to_float32(weight[e], dtype)
        w += np.float32(pair.scaling) * (delta.T if transpose else delta)
        merged[e] = from_float32(w, dtype)
    return merged
