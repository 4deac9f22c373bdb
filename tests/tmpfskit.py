"""A small tmpfs a test mounts and unmounts itself: a real filesystem that runs out of space (ENOSPC from the
kernel, not a mock). Mounting needs CAP_SYS_ADMIN (root here); elsewhere `mounted_tmpfs` skips with the reason."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: str, skip: bool = True) -> Iterator[Path]:
    """`where` as a tmpfs of `size` (mount(8)'s spelling: 3M, 512k) for the body; unmounted after, always."""
    where.mkdir(parents=True, exist_ok=True)
    done = _mount(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "kora-test", str(where)])
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {done.stderr.strip()}"
        if skip:
            pytest.skip(reason)
        raise RuntimeError(reason)
    try:
        yield where
    finally:
        _mount(["umount", "--lazy", str(where)])


def resize_tmpfs(where: Path, size: str) -> None:
    done = _mount(["mount", "-o", f"remount,size={size}", str(where)])
    if done.returncode != 0:
        raise RuntimeError(f"remount {where} size={size}: {done.stderr.strip()}")
