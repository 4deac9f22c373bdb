"""Which LoRA modules an engine build can carry that the trainer can train, and the one rule that follows.

A Qwen3.5-style GDN (gated delta net, linear-attention) layer has four input projections in HF / PEFT
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`: Megatron's one fused `in_proj`). SGLang serves them as two
fused modules, `in_proj_qkvz` and `in_proj_ba`, and the stock build hosts a LoRA on the first only:

- sglang 0.5.23 (the wheel; `python/sglang/srt/models/qwen3_5.py`): `Qwen3_5ForCausalLM.packed_modules_mapping`
  (line 1710) packs `in_proj_qkvz <- [in_proj_qkv, in_proj_z]` and `in_proj_ba <- [in_proj_b, in_proj_a]`, and its
  `supported_lora_modules` (line 1717) lists `in_proj_qkvz` but not `in_proj_ba`; `sglang/srt/lora/utils.py:412`
  `_KNOWN_LORA_TARGET_MODULES` has no `in_proj_ba` either. So a b/a adapter cannot be served there: sgl-project/sglang
  #30499 (merged on the sglang-miles branch, 2026-07-08; its port to main, #31522, is open) describes such weights
  as "silently dropped at load time" — the engine serves base weights for the beta/alpha gates.
- the sglang-miles branch with #30499 carries them (`in_proj_ba` in supported_lora_modules, `_normalize_in_proj_ba`).

Relax's answer, which kora follows: in Adapter mode on a build without b/a adapters, the b/a rows of the in_proj
adapter are pinned to zero by a forward mask, so they get zero gradient and add nothing to the trainer's forward —
the policy trained is the policy served. Merge mode folds every row into the base weights (the engine needs no
LoRA at all), so nothing is masked there; EngineMerge is kora's reference engine folding HF-named pairs: the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from kora_trainer.config.sections import SyncMode


@dataclass(frozen=True)
class EngineLoRALimits:
    """What one engine build can host as a LoRA module, where the trainer would otherwise train more."""

    name: str
    gdn_gate_adapters: bool  # a LoRA on GDN's b/a gate projections (SGLang's fused `in_proj_ba`)
    evidence: str  # where that fact was read


STOCK_SGLANG = EngineLoRALimits(
    name="sglang 0.5.23", gdn_gate_adapters=False,
    evidence="sglang 0.5.23 models/qwen3_5.py:1717 supported_lora_modules (in_proj_qkvz, no in_proj_ba); "
             "lora/utils.py:412 _KNOWN_LORA_TARGET_MODULES")
SGLANG_MILES_GDN_GATES = EngineLoRALimits(
    name="sglang-miles with #30499", gdn_gate_adapters=True,
    evidence="sgl-project/sglang #30499 (sglang-miles, merged 2026-07-08): in_proj_ba LoRA, _normalize_in_proj_ba")


def engine_lora_limits() -> EngineLoRALimits:
    """The limits of the build the job's engines run. Every job runs the stock build's answer today (kora's
    reference engine behaves as it by default); naming another build is issue 19's `rollout.sglangBuild`."""
    return STOCK_SGLANG


def gdn_gate_mask_needed(sync_mode: SyncMode, engine_carries_gate_adapters: bool = STOCK_SGLANG.gdn_gate_adapters
                         ) -> bool:
    """Whether the b/a rows of GDN in_proj adapters are pinned to zero: only where the trained adapter is served as
    an adapter (Adapter mode) by a build that has nowhere to put them. Merge / EngineMerge fold them losslessly."""
    return sync_mode is SyncMode.ADAPTER and not engine_carries_gate_adapters
