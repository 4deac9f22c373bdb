"""LoRA IPC merge, both halves as pure functions: the trainer packs A/B pairs into buckets (a layer's pair never
split), the engine folds each pair into a pristine copy of its base weight.

What is matched (the seed ../shared/seeds/miles-diffusion-lora-sync.txt §3, and the code behind it):
- names: PEFT's `base_model.model.<layer>.lora_A.weight` -> sglang-diffusion's `<layer>.lora_A` (miles'
  `PeftLoRAKeyMapper.to_sgld_name` in radixark/miles_diffusion miles/backends/fsdp_utils/
  diffusion_update_weight_utils.py: strip the PEFT prefix, keep the layer prefix and `lora_A` / `lora_B`, drop an
  adapter name and `.weight`). That version is not the one at the fetched HEAD 2929e491 (which has only the full
  and train-side-merge updaters): it was read from the code index, commit not shown there.
- buckets: the packer walks LAYER GROUPS, not tensors; when the next group would pass the cap the bucket is
  flushed first and the whole group starts the next one (so a group larger than the cap is a bucket of its own).
- the engine's fold (`weight_update_mode="lora_merge"` with `lora_alpha`, `lora_rank`; sglang PR #31029, as the
  issue records it): W = W0 + (alpha / r) B A from a pristine copy W0 kept at load, every sync, so folds never
  accumulate; in fp32 when the forward is fp32 (`SGLANG_DIFFUSION_LORA_MERGE_FP32=1`), else in the weight's dtype.
- the first-sync log line: `LoRA IPC weight sync v1 [transformer]: pushed N lora tensors, M layer prefixes in K
  buckets (unmapped=0)`.
The transport is wire/diffusion_client.py's (one flattened bucket per call: wire/flat_bucket.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

LORA_MERGE = "lora_merge"  # the engine's weight_update_mode for pushed A/B pairs
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"\.lora_([AB])(?:\.[^.]+)?(?:\.weight)?$")
Named = tuple[str, torch.Tensor]


def sgld_name(peft_name: str) -> str | None:
    """'base_model.model.transformer_blocks.0.attn.to_q.lora_A.weight' -> 'transformer_blocks.0.attn.to_q.lora_A';
    None for a name that is no LoRA factor."""
    name = peft_name[len(_PEFT_PREFIX):] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    match = _LORA_KEY.search(name)
    return None if match is None else f"{name[:match.start()]}.lora_{match.group(1)}"


@dataclass(frozen=True)
class LayerGroup:
    """One adapted layer's factors under engine names: A [r, in], B [out, r]."""

    prefix: str  # 'transformer_blocks.0.attn.to_q'
    a: torch.Tensor
    b: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def named(self) -> list[Named]:
        return [(f"{self.prefix}.lora_A", self.a), (f"{self.prefix}.lora_B", self.b)]


def layer_groups(tensors: Iterable[Named]) -> tuple[list[LayerGroup], list[str]]:
    """PEFT-named factors -> (their layer groups in first-seen order, the names that mapped to nothing).

    A layer with only one of its factors is an error: the engine could not fold it.
    """
    halves: dict[str, dict[str, torch.Tensor]] = {}
    unmapped: list[str] = []
    for name, t in tensors:
        mapped = sgld_name(name)
        if mapped is None:
            unmapped.append(name)
            continue
        prefix, _, factor = mapped.rpartition(".")
        halves.setdefault(prefix, {})[factor] = t
    lonely = [p for p, h in halves.items() if set(h) != {"lora_A", "lora_B"}]
    if lonely:
        raise ValueError(f"LoRA factors without their partner for {lonely[:3]}: every layer needs lora_A and lora_B")
    return [LayerGroup(p, h["lora_A"], h["lora_B"]) for p, h in halves.items()], unmapped


def pack_pair_buckets(groups: Sequence[LayerGroup], cap_bytes: int) -> list[list[LayerGroup]]:
    """Buckets of whole layer groups: flush before a group that would pass `cap_bytes`; never split a group."""
    if cap_bytes < 1:
        raise ValueError(f"sync.bufferSize {cap_bytes} must be at least 1 byte")
    buckets: list[list[LayerGroup]] = []
    current: list[LayerGroup] = []
    size = 0
    for g in groups:
        if current and size + g.nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(g)
        size += g.nbytes
    if current:
        buckets.append(current)
    return buckets


def split_pairs(buckets: Sequence[Sequence[Named]]) -> list[str]:
    """The layer prefixes whose lora_A and lora_B do not travel in the same bucket (what must never happen)."""
    where: dict[str, set[int]] = {}
    for i, bucket in enumerate(buckets):
        for name, _ in bucket:
            where.setdefault(name.rpartition(".")[0], set()).add(i)
    return sorted(p for p, seen in where.items() if len(seen) > 1)


def sync_log_line(version: int, module: str, buckets: Sequence[Sequence[LayerGroup]], unmapped: int) -> str:
    n_groups = sum(len(b) for b in buckets)
    return (f"LoRA IPC weight sync v{version} [{module}]: pushed {2 * n_groups} lora tensors, {n_groups} layer "
            f"prefixes in {len(buckets)} buckets (unmapped={unmapped})")


def checked_pairs(bucket: Iterable[Named], pristine: Mapping[str, torch.Tensor],
                  live: Mapping[str, torch.Tensor] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """A lora_merge bucket as {layer prefix: {"lora_A": [r, in], "lora_B": [out, r]}}, in bucket order, once every
    pair is whole, names a weight the engine has (in `pristine`, and in `live` when given) and folds into its shape;
    else ValueError / KeyError naming the layer. Nothing is written before this passes, so a bad bucket changes
    no weight."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in bucket:
        prefix, _, factor = name.rpartition(".")
        halves.setdefault(prefix, {})[factor] = t
    for prefix, h in halves.items():
        if set(h) != {"lora_A", "lora_B"}:
            raise ValueError(f"bucket holds {sorted(h)} for {prefix}: a lora_merge bucket carries whole A/B pairs")
        key = f"{prefix}.weight"
        if key not in pristine or (live is not None and key not in live):
            raise KeyError(f"{key}: the engine's transformer has no such weight (unmapped LoRA target)")
        (out_dim, in_dim), a, b = pristine[key].shape, h["lora_A"], h["lora_B"]
        if b.shape[0] != out_dim or a.shape[1] != in_dim or a.shape[0] != b.shape[1]:
            raise ValueError(f"{prefix}: lora_B {list(b.shape)} @ lora_A {list(a.shape)} does not fold into its weight "
                             f"[{out_dim}, {in_dim}]")
    return halves


def fold_from_pristine(pristine: Mapping[str, torch.Tensor], bucket: Iterable[Named], lora_alpha: float,
                       lora_rank: int, fp32: bool = True) -> dict[str, torch.Tensor]:
    """The engine's lora_merge of one bucket, layer by layer: {'<layer>.weight': W0 + (alpha / r) B A} from the
    pristine copy — the reference the engine's stacked folds (kora_engine/diffusion/stacked_fold.py) are held to.

    `pristine` holds each base weight as loaded ([out, in]). fp32: the sum formed in fp32 and rounded once to W0's
    dtype; otherwise formed in W0's dtype (the seed's fp16 merge). The ops are the trainer's `folded_weight` ones,
    in its order (B A, then the scaling, then the sum): an fp32 fold here is bit-equal to the trainer's.
    """
    halves = checked_pairs(bucket, pristine)
    scaling = lora_alpha / lora_rank
    out: dict[str, torch.Tensor] = {}
    for prefix, h in halves.items():
        w0 = pristine[f"{prefix}.weight"]
        work = torch.float32 if fp32 else w0.dtype
        delta = h["lora_B"].to(work) @ h["lora_A"].to(work)  # [out, r] @ [r, in]
        delta.mul_(scaling)
        out[f"{prefix}.weight"] = (w0.to(work) + delta).to(w0.dtype)
    return out
