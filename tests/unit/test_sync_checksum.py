"""The weight-sync checksum: what the trainer and the engine compare after every push. It must move when
any byte, position, name, dtype or shape differs, and be the same wherever it is computed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kora_trainer.wire import protocol
from kora_trainer.wire.protocol import checksum, fingerprint


def reference_fingerprint(t: torch.Tensor, chunk: int) -> tuple[int, int]:
    """The same two sums written out in numpy, independently of torch's reductions."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    if len(raw) % 2:
        raw += b"\0"
    words = np.frombuffer(raw, dtype=np.int16).astype(np.int64)
    plain = int(words.sum())
    weighted = 0
    for i, start in enumerate(range(0, len(words), chunk)):
        c = words[start:start + chunk]
        weighted += int((c * (np.arange(len(c)) % 65521 + 1)).sum()) * (i + 1)
    return plain, weighted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_fingerprint_is_the_exact_integer_sums(monkeypatch, dtype):
    monkeypatch.setattr(protocol, "_CHUNK", 1000)  # several chunks on a small tensor
    monkeypatch.setattr(protocol, "_WEIGHTS", {})
    t = (torch.randn(37, 91) * 50).to(dtype)  # odd byte count for uint8
    assert fingerprint(t) == reference_fingerprint(t, 1000)


def test_checksum_moves_with_any_change():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 32, generator=g), torch.randn(16, generator=g)
    base = checksum([("a", a), ("b", b)])
    swapped = a.clone()
    swapped[0, 0], swapped[5, 7] = a[5, 7], a[0, 0]  # same bytes, other places
    one_bit = a.clone()
    one_bit.view(torch.int32)[3, 3] ^= 1
    variants = [
        [("a", swapped), ("b", b)], [("a", one_bit), ("b", b)], [("b", b), ("a", a)], [("x", a), ("b", b)],
        [("a", a.reshape(32, 64)), ("b", b)], [("a", a.view(torch.int32)), ("b", b)],
    ]
    sums = {checksum(v) for v in variants}
    assert base not in sums and len(sums) == len(variants)
    assert checksum([("a", a.clone()), ("b", b.clone())]) == base  # the same content, another storage


def test_a_noncontiguous_view_hashes_its_values():
    t = torch.randn(8, 6)
    assert checksum([("t", t.T)]) == checksum([("t", t.T.contiguous())])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_and_cpu_agree():
    t = torch.randn(4097, 513).to(torch.bfloat16)
    assert checksum([("t", t.cuda())]) == checksum([("t", t)])
