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

import errno
import hashlib
import io
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
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors

from kora_trainer.checkpoint.faults import KILL_AT
from kora_trainer.checkpoint.precision import EXACT, as_trained, split_for_file

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
    adapter: dict[str, torch.Tensor]  # as the run held it (exact, whatever the file's dtype)
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
        import numpy as np  # noqa: PLC0415 - numpy is optional here

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
        import numpy as np  # noqa: PLC0415 - numpy is optional here

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
         meta: Mapping[str, Any] | None = None, keep: int = 2, dtype: torch.dtype | None = None) -> Path:
    """Write checkpoint `step` atomically under `root`, move `latest`, prune to `keep`. `dtype`: the adapter
    file's (checkpoint.dtype; None: the adapter's own), exact values kept where it rounds (precision.py).

    The files are serialized in memory first (a checkpoint is the adapter and its optimizer state, not the
    model), so the bytes needed are known before anything is written: a volume without room for them is
    refused up front, and a write the disk runs out under (ENOSPC, EDQUOT, EFBIG) is a CheckpointWriteError
    naming the file and the bytes. Either way the temp dir goes and `latest` still names the previous
    checkpoint. (safetensors' and torch's own file writers say neither: "I/O error: No space left on
    device (os error 28)" and "unexpected pos 576 vs 534".)"""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    blobs = _serialize(step, adapter, optimizer, scheduler, rng, meta, dtype)
    needed = sum(len(b) for b in blobs.values())
    _check_room(root, step, needed)
    KILL_AT.write_started()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the checkpoint from other readers of the volume
        for name, data in blobs.items():
            _write(tmp / name, data, step, needed)
        _fsync(tmp)
        KILL_AT.reached("files")
        if final.exists():  # re-saving a step (e.g. after a resume) replaces it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    KILL_AT.reached("renamed")
    pointer = root / f".{LATEST}.tmp"
    try:
        _write(pointer, (final.name + "\n").encode(), step, needed)
    except CheckpointWriteError:
        shutil.rmtree(final, ignore_errors=True)  # keep "latest = the newest good one" true: it still names the last
        pointer.unlink(missing_ok=True)
        raise
    os.replace(pointer, root / LATEST)
    _fsync(root)
    _prune(root, keep, final)
    return final


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the disk is full, a quota or a file-size limit): the message names
    the step, the path, the bytes it needs and what is free; the previous checkpoint stays the newest good one."""

    def __str__(self) -> str:  # the message alone: OSError's "[Errno 28] ...: 'path'" would repeat the path
        return str(self.strerror)


_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _serialize(step: int, adapter: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any],
               scheduler: Mapping[str, Any] | None, rng: Mapping[str, Any] | None,
               meta: Mapping[str, Any] | None, dtype: torch.dtype | None) -> dict[str, bytes]:
    """The checkpoint's files as bytes, the manifest last (its sums are of exactly these bytes)."""
    written, exact = split_for_file(adapter, dtype)
    state = io.BytesIO()
    torch.save({"optimizer": dict(optimizer), "scheduler": dict(scheduler) if scheduler else None,
                "rng": dict(rng) if rng is not None else capture_rng(), EXACT: exact}, state)
    blobs = {
        ADAPTER: save_tensors(written),
        TRAINER_STATE: state.getvalue(),
        META: json.dumps({"format": FORMAT, "step": step, **(meta or {})}, indent=2).encode(),
    }
    files = {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
             for name, data in sorted(blobs.items())}
    blobs[MANIFEST] = json.dumps({"step": step, "files": files}, indent=2).encode()
    return blobs


def _free_bytes(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def _check_room(root: Path, step: int, needed: int) -> None:
    free = _free_bytes(root)
    if free < needed:
        raise CheckpointWriteError(errno.ENOSPC, f"checkpoint step {step}: not written, {root} has {free} bytes free "
                                   f"and the checkpoint needs {needed} (ENOSPC); {_still_newest(root)}. {_FIX}",
                                   str(root))


_FIX = ("Free space on checkpoint.path's volume or make it bigger (it holds checkpoint.keep checkpoints plus the "
        "one being written), or lower checkpoint.keep")


def _still_newest(root: Path) -> str:
    pointer = root / LATEST
    return (f"the newest good checkpoint is still {root / pointer.read_text().strip()}" if pointer.exists()
            else "no earlier checkpoint exists")


def _write(path: Path, data: bytes, step: int, needed: int) -> None:
    """Write and fsync one file; a full disk (or quota, or RLIMIT_FSIZE) becomes a CheckpointWriteError."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno not in _NO_ROOM:
            raise
        root = path.parent if path.name.startswith(f".{LATEST}") else path.parent.parent
        raise CheckpointWriteError(e.errno, f"checkpoint step {step}: not written, {errno.errorcode[e.errno]} "
                                   f"({os.strerror(e.errno)}) writing {path} ({len(data)} bytes; the checkpoint "
                                   f"needs {needed} in all, {_free_bytes(root)} free now); {_still_newest(root)}. "
                                   f"{_FIX}", str(path)) from e


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


def load_dir(path: Path, map_location: str = "cpu", skipped: list[str] | None = None) -> Checkpoint:
    """The checkpoint in `path` (a `step_NNNNNNNN` directory; verify it first), its adapter as the run held it
    (the exact values where the file's dtype rounded them)."""
    path = Path(path)
    state = torch.load(path / TRAINER_STATE, map_location=map_location, weights_only=False)
    meta = json.loads((path / META).read_text())
    adapter = as_trained(load_file(str(path / ADAPTER)), state.get(EXACT))
    return Checkpoint(int(meta["step"]), path, adapter, state["optimizer"], state["scheduler"], state["rng"], meta,
                      list(skipped or []))


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
        return load_dir(path, map_location, skipped)
    if skipped:
        raise CheckpointError("no checkpoint under {} verifies:\n  {}".format(root, "\n  ".join(skipped)))
    return None


def select_state(optimizer: Mapping[str, Any], names: list[str], mine: list[str]) -> dict[str, Any]:
    """The AdamW state of parameters `mine` (this rank's, in its optimizer's order) out of a checkpoint's state
    over `names` (the checkpoint's order), by name."""
    index = {n: i for i, n in enumerate(names)}
    state = {j: optimizer["state"][index[n]] for j, n in enumerate(mine) if index[n] in optimizer["state"]}
    groups = [{**g, "params": list(range(len(mine)))} for g in optimizer["param_groups"]]
    return {**optimizer, "state": state, "param_groups": groups}
