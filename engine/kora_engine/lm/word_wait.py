"""A one-thread GPU kernel that returns once an int64 word of host memory reaches a value (the colocated
handshake's GATE, kora_engine/lm/word_gate.py): work enqueued after it on the same stream starts the moment the
trainer's store lands, with no engine thread between the store and the GPU.

The word is read with volatile loads (system scope: each one a read of the mapped host memory), so the kernel
sees the store within a read's latency. One program of one warp: it holds one SM's slot while it spins, and is
only enqueued under the engine's weight lock, always released by a store of the word.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


class _Address:
    """A device address as Triton takes a pointer argument (`data_ptr()` and the element type)."""

    def __init__(self, address: int, dtype: torch.dtype = torch.int64):
        self.address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self.address


if triton is not None:
    # triton.jit is untyped, and Triton reads a kernel's annotations itself: left off for mypy (the ignores)
    @triton.jit(do_not_specialize=["n"])
    def _spin_until(word_ptr, n):  # type: ignore[no-untyped-def]
        value = tl.load(word_ptr, volatile=True)
        while value < n:
            value = tl.load(word_ptr, volatile=True)


def spin_until(address: int, n: int) -> None:
    """Enqueue on the current stream: return once the int64 at device `address` (host memory mapped for the
    device) is >= n."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("the word wait kernel needs Triton (CUDA builds of torch ship it)")
    _spin_until[(1,)](_Address(address), n, num_warps=1)
