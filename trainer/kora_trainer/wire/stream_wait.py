"""A CUDA stream that waits, on the device, for a word in device memory to reach a value (the driver's stream
memory operations). The colocated EngineMerge push uses it so that the engine's fold can be enqueued before the
trainer has written the ring slot: the engine's stream waits for `go >= n`, and the trainer's own stream stores
n into `go` (mapped through CUDA IPC) right after its gather, so the fold starts on the device with no host step
in between (sync/colocated_sender.py, reference_engine/colocated_routes.py).

Why ctypes: torch exposes no stream memory operations and cuda-python is not in the images; this is one entry
point of the driver's stable C API (`cuStreamWaitValue32`)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*addr - value) >= 0, so n may wrap


@functools.cache
def _driver() -> tuple[Any, Any, str | None]:
    """(the driver library, its cuStreamWaitValue32, None) or (None, None, why not)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return None, None, f"no CUDA driver library: {e}"
    wait = getattr(lib, "cuStreamWaitValue32_v2", None) or getattr(lib, "cuStreamWaitValue32", None)
    if wait is None:
        return None, None, "the CUDA driver has no cuStreamWaitValue32"
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wait.restype = ctypes.c_int
    return lib, wait, None


def unsupported(device: torch.device) -> str | None:
    """Why a stream on `device` cannot wait on a word, or None when it can (a real wait, already satisfied, on a
    stream of its own: the driver's own answer rather than an attribute CUDA 12 retired)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"{device} is not a CUDA device"
    _, _, problem = _driver()
    if problem is not None:
        return problem
    word = torch.ones(1, dtype=torch.int32, device=device)
    stream = torch.cuda.Stream(device)
    try:
        wait_geq(stream, word, 1)
        stream.synchronize()
    except RuntimeError as e:
        return str(e)
    return None


def wait_geq(stream: torch.cuda.Stream, word: torch.Tensor, value: int) -> None:
    """Enqueue on `stream`: wait until the int32 `word` (device memory) holds `value` or more (wrapping)."""
    if word.dtype != torch.int32 or not word.is_cuda:
        raise ValueError(f"the word a stream waits on is int32 in device memory, got {word.dtype} on {word.device}")
    _, wait, problem = _driver()
    if problem is not None:
        raise RuntimeError(problem)
    rc = wait(stream.cuda_stream, word.data_ptr(), value & 0xFFFFFFFF, WAIT_VALUE_GEQ)
    if rc != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {rc})")
