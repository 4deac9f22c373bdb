"""LoRA-only resumable checkpoints: adapter + optimizer + scheduler + RNG + step + data position.

The frozen base is not saved (it is reloaded from model.path on resume), so a checkpoint is the
size of the adapter and its optimizer state. Writes are atomic: everything goes into a temp dir
that is fsynced and renamed to `step_NNNNNNNN`, and only then does the `latest` pointer move. A
manifest of sha256 sums lets a load refuse a torn or corrupted checkpoint and fall back to the
previous good one.

What the train loop puts in, and what a resumed run reproduces (exactly with deployment.async false; with
async true step K+1's rollouts are regenerated from policy K): checkpoint/training.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LATEST = "latest"
MANIFEST = "manifest.json"
ADAPTER = "adapter.safetensors"
TRAINER_STATE = "trainer_state.pt"
META = "meta.json"
FORMAT = "kora-lora-only/1"
_LORA_NAME = re.compile(r"(^|\.)lora_[AB](\.|$)")


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded; the message names the directory and what is wrong."""


@dataclass
class Checkpoint:
    step: int
    path: Path
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    rng: dict[str, Any]
    meta: dict[str, Any]
    skipped: list[str] = field(default_factory=list)  # newer checkpoints refused, with reasons


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def check_lora_only(named_trainable: Iterable[str], is_lora: Any = None) -> None:
    """SPEC rule 8: a LoRA-only checkpoint of a model with other trainable parameters would resume
    without them. `is_lora(name)` defaults to "lora_A"/"lora_B" in the name."""
    test = is_lora or (lambda n: _LORA_NAME.search(n) is not None)
    others = sorted(n for n in named_trainable if not test(n))
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise CheckpointError(f"checkpoint.loraOnly: trainable parameters that are not LoRA would be lost on "
                              f"resume: {shown}. Freeze them, or set checkpoint.loraOnly to false")


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional for the checkpoint itself
        pass
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: Path, step: int, *, adapter: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any],
         scheduler: Mapping[str, Any] | None, rng: Mapping[str, Any] | None = None,
         meta: Mapping[str, Any] | None = None, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically under `root`, move `latest`, prune to `keep`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the checkpoint from other readers of the volume
        save_file({k: v.detach().contiguous().cpu() for k, v in adapter.items()}, str(tmp / ADAPTER))
        torch.save({"optimizer": dict(optimizer), "scheduler": dict(scheduler) if scheduler else None,
                    "rng": dict(rng) if rng is not None else capture_rng()}, tmp / TRAINER_STATE)
        (tmp / META).write_text(json.dumps({"format": FORMAT, "step": step, **(meta or {})}, indent=2))
        files = sorted(p.name for p in tmp.iterdir())
        manifest = {name: {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in files}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=2))
        for name in [*files, MANIFEST]:
            _fsync(tmp / name)
        _fsync(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume) replaces it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    _fsync(pointer)
    os.replace(pointer, root / LATEST)
    _fsync(root)
    _prune(root, keep, final)
    return final


def _steps(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: p.name, reverse=True)


def _prune(root: Path, keep: int, newest: Path) -> None:
    for old in _steps(root)[max(keep, 1):]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step_*.tmp-*"):  # torn writes of earlier, killed runs
        shutil.rmtree(stale, ignore_errors=True)


def verify(path: Path) -> None:
    """Raise CheckpointError unless every file matches the manifest."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"{path}: no {MANIFEST} (a half-written checkpoint); it will not be loaded")
    try:
        manifest = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path}/{MANIFEST}: unreadable ({e})") from e
    for name, info in manifest.items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{path}: {name} is missing")
        if f.stat().st_size != info["bytes"] or _sha256(f) != info["sha256"]:
            raise CheckpointError(f"{path}: {name} fails its checksum (corrupted or torn write)")


def load_latest(root: Path, map_location: str = "cpu") -> Checkpoint | None:
    """The newest checkpoint that verifies (the `latest` one first); None when there is none.

    Refused checkpoints are listed in `Checkpoint.skipped` so the caller can log why."""
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = _steps(root)
    pointer = root / LATEST
    if pointer.exists():
        named = root / pointer.read_text().strip()
        candidates = [named, *[c for c in candidates if c != named]]
    skipped: list[str] = []
    for path in candidates:
        try:
            verify(path)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        state = torch.load(path / TRAINER_STATE, map_location=map_location, weights_only=False)
        meta = json.loads((path / META).read_text())
        return Checkpoint(int(meta["step"]), path, load_file(str(path / ADAPTER)), state["optimizer"],
                          state["scheduler"], state["rng"], meta, skipped)
    if skipped:
        raise CheckpointError("no checkpoint under {} verifies:\n  {}".format(root, "\n  ".join(skipped)))
    return None
