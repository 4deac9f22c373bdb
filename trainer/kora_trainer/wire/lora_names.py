"""How LoRA tensors are named on the wire: HF-PEFT names, `<module>.lora_A.weight` / `.lora_B.weight` under
PEFT's `base_model.model.` prefix (what `load_lora_adapter_from_tensors` and the fast adapter push carry)."""

from __future__ import annotations

import re

PEFT_PREFIX = "base_model.model."
LORA_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


def split_lora_name(name: str) -> tuple[str, str] | None:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> ('model.layers.0.self_attn.q_proj', 'A')."""
    m = LORA_RE.match(name.removeprefix(PEFT_PREFIX))
    return (m["module"], m["which"]) if m else None
