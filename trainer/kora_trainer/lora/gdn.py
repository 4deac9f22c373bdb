"""GDN (gated delta net) layers: their projection names and the Adapter-mode gate mask.

transformers 5's Qwen3.5 / Qwen3.5-MoE `GatedDeltaNet` (models/qwen3_5/modeling_qwen3_5.py, `Qwen3_5GatedDeltaNet`)
holds Megatron's fused `in_proj` as four nn.Linear — `in_proj_qkv` [2·key_dim + value_dim, hidden] (query, key,
value: split in that order after the conv), `in_proj_z` [value_dim, hidden] (the output gate), `in_proj_b` and
`in_proj_a` [num_v_heads, hidden] (beta = sigmoid(b) and the decay gate from a) — and `out_proj`. The config maps
`in_proj` onto the four and `out_proj` onto `out_proj` (config/sections.py MEGATRON_TO_HF).

Where the engine build cannot host a b/a adapter (config/engine_lora_limits.py), Adapter mode pins the in_proj
adapter's b/a rows to zero (`pin_gate_rows`): in HF's layout those rows are the whole `in_proj_b` / `in_proj_a`
adapters. `GATE_MASK_OFF_ENV` switches the pin off — a test-only fault (never set in production) that shows the
served-vs-trainer check catching an adapter the engine does not serve.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kora_trainer.lora.layer import LoRALinear

IN_PROJ_QKV, IN_PROJ_Z, IN_PROJ_B, IN_PROJ_A = "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"
GATE_LEAVES = (IN_PROJ_B, IN_PROJ_A)
# SGLang's fused modules (sglang 0.5.23 models/qwen3_5.py:1710 packed_modules_mapping)
SGLANG_QKVZ, SGLANG_BA = "in_proj_qkvz", "in_proj_ba"
GATE_MASK_OFF_ENV = "KORA_TRAINER_FAULT_GDN_GATES_UNMASKED"


def leaf(module_name: str) -> str:
    return module_name.rsplit(".", 1)[-1]


def gdn_modules(model: nn.Module) -> list[str]:
    """Names of the LoRA-wrapped GDN input projections (any of the four)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, LoRALinear) and leaf(n) in (IN_PROJ_QKV, IN_PROJ_Z, *GATE_LEAVES)]


def pin_gate_rows(model: nn.Module) -> list[str]:
    """Pin every GDN b/a adapter's rows to zero (zero B, forward mask: zero gradient); returns what was pinned.
    Inert (returns []) while the test-only `GATE_MASK_OFF_ENV` is set."""
    if os.environ.get(GATE_MASK_OFF_ENV):
        return []
    pinned = []
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear) and leaf(name) in GATE_LEAVES:
            m.pin_rows(torch.ones(m.out_features, dtype=torch.bool))  # all of in_proj_b / in_proj_a's rows
            pinned.append(name)
    return pinned
