"""One multi-LoRA adapter's resumable checkpoint: `<checkpoint.path>/adapters/<name>/checkpoint/`.

LoRA-only, like the single-adapter checkpoint: its factors (adapter.safetensors, HF-PEFT names), its AdamW state,
its step, its dropout RNG stream, its learning-rate schedule and its data position (state.pt), and a meta.json.
Written into a temp dir and renamed over the previous one, so a torn write never replaces a good checkpoint; the
base is reloaded from model.path on resume. Its HF-PEFT export goes beside it (`<name>/lora_adapter/`,
checkpoint/peft_export.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kora_trainer.checkpoint.precision import EXACT, as_trained, split_for_file
from kora_trainer.checkpoint.swap_dir import swapped_in

CHECKPOINT_DIR = "checkpoint"


def adapter_root(root: str | Path, name: str) -> Path:
    return Path(root) / "adapters" / name


def save_slot(root: str | Path, name: str, state: dict[str, Any], data_position: int,
              meta: dict[str, Any], dtype: torch.dtype | None = None) -> Path:
    """Write `state` (MultiLoRATrainer.state: tensors, optimizer, step, rng, schedule) atomically; returns the
    directory. `dtype`: the adapter file's (checkpoint.dtype), exact values kept where it rounds (precision.py)."""
    home = adapter_root(root, name)
    written, exact = split_for_file(state["tensors"], dtype)
    with swapped_in(home, CHECKPOINT_DIR) as tmp:  # the previous checkpoint stays whole until the new one is in
        save_file(written, str(tmp / "adapter.safetensors"))
        schedule = state.get("schedule")
        torch.save({"optimizer": state["optimizer"], "step": state["step"], "rng": state["rng"],
                    "schedule": schedule, "data_position": data_position, EXACT: exact}, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({**meta, "name": name, "step": state["step"], "schedule": schedule,
                                                   "data_position": data_position}, indent=1) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    return home / CHECKPOINT_DIR


def load_slot(root: str | Path, name: str) -> tuple[dict[str, Any], int] | None:
    """(state for MultiLoRATrainer.load_state, data position) of its checkpoint, or None when it has none."""
    home = adapter_root(root, name)
    d = home / CHECKPOINT_DIR
    if not (d / "state.pt").is_file():
        old = home / f".{CHECKPOINT_DIR}.old"  # a crash between the two renames leaves only the old one
        if not (old / "state.pt").is_file():
            return None
        d = old
    extra = torch.load(d / "state.pt", weights_only=False)
    state = {"tensors": as_trained(load_file(str(d / "adapter.safetensors")), extra.get(EXACT)),
             "optimizer": extra["optimizer"],
             "step": extra["step"], "rng": extra["rng"], "schedule": extra.get("schedule")}
    return state, int(extra["data_position"])
