"""A GPU stream held until a word of the colocated handshake (wire/colocated_words.py) reaches a value.

The words live in CPU shared memory, written by the trainer's process. Registered with CUDA (page-locked and
mapped for the device), a word can gate a stream: a one-thread kernel (kora_engine/lm/word_wait.py) spins on it, so work
the engine enqueues after it — an armed push's gather and fold (colocated_routes.arm_slot) — starts the moment the
trainer's one store of the word lands, with no engine thread between the store and the GPU. torch registers host
memory but does not say where the device sees it: the registration comes from NVIDIA's own binding of the driver
API (`cuda.bindings`, which torch's Linux wheels depend on).

The stream's other work waits behind the kernel, and the kernel holds one SM's slot of the engine's context while
it spins, so a gate is only set under the weight lock and always opened again: by the trainer's push, or by the
engine's own store of the word (a cancel). A stream wait on the word (`cuStreamWaitValue64`) needs no kernel, but
the GPU re-polls a waiting stream only every so often: on an H100 the fold started ~0.2 ms after the store, no
sooner than an unarmed push's launch (docs/megatron_backend.md, session 23).
"""

from __future__ import annotations

import logging
import mmap
from typing import Any

import torch

from kora_engine.lm.word_wait import spin_until

log = logging.getLogger("kora.hf_engine")


def _check(result: Any, what: str) -> Any:
    """cuda.bindings answers (CUresult, *values): the values, or RuntimeError naming the call and the error."""
    from cuda.bindings import driver  # noqa: PLC0415 - cuda-python only on a GPU

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err.name}")
    return values[0] if len(values) == 1 else values


class WordGate:
    """The words of one handshake (`words`: the int64 CPU tensor in shared memory) registered for `device` (an
    index); make it with `WordGate.open`."""

    def __init__(self, words: torch.Tensor, device: torch.device):
        from cuda.bindings import driver  # noqa: PLC0415 - cuda-python only on a GPU

        self.driver = driver
        page = mmap.PAGESIZE
        start = words.data_ptr()
        self.base = start - start % page  # registration takes whole pages: the words' mapping spans them
        end = start + words.numel() * words.element_size()
        size = -(-(end - self.base) // page) * page
        # the device's primary context (torch's), current on this thread for the registration
        self.cu_device = _check(driver.cuDeviceGet(device.index), "cuDeviceGet")
        self.ctx = _check(driver.cuDevicePrimaryCtxRetain(self.cu_device), "cuDevicePrimaryCtxRetain")
        flags = driver.CU_MEMHOSTREGISTER_DEVICEMAP | driver.CU_MEMHOSTREGISTER_PORTABLE
        registered = False
        try:
            _check(driver.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            _check(driver.cuMemHostRegister(self.base, size, flags), "cuMemHostRegister of the handshake words")
            registered = True
            dbase = int(_check(driver.cuMemHostGetDevicePointer(self.base, 0), "cuMemHostGetDevicePointer"))
            self.words_at = dbase + (start - self.base)  # word 0 as the device addresses it
            self.device = device
            self.words = words  # the storage stays alive while registered
            with torch.cuda.device(device):  # the kernel compiled now, not at the first arm: REQ (word 0) is >= 0
                spin_until(self.words_at, 0)
                torch.cuda.synchronize(device)
        except BaseException:
            if registered:
                driver.cuMemHostUnregister(self.base)
            driver.cuDevicePrimaryCtxRelease(self.cu_device)
            raise

    @classmethod
    def open(cls, words: torch.Tensor, device: torch.device) -> WordGate | None:
        """A gate over `words` on `device`; None, with the reason logged, where there is none (no GPU, no binding,
        a registration or a kernel that fails): the arm then warms the push's launch instead."""
        if device.type != "cuda":
            return None
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            return cls(words, torch.device("cuda", index))
        except Exception as e:
            log.warning("colocated EngineMerge: no GPU-side gate on the handshake words (%s); armed pushes warm their "
                        "launch instead of prelaunching it", e)
            return None

    def hold(self, word: int, n: int) -> None:
        """The current stream of `device` waits, on the GPU, until words[word] >= n (the request numbers only
        grow); what is enqueued after this runs once it is."""
        spin_until(self.words_at + 8 * word, n)

    def close(self) -> None:
        if self.base:
            self.driver.cuMemHostUnregister(self.base)
            self.driver.cuDevicePrimaryCtxRelease(self.cu_device)
            self.base = 0
