"""The fold entry point: fp32 accumulate, one rounding; the Triton path is checked on GPU."""

from __future__ import annotations

import pytest
import torch

from kora_trainer.kernels.fold import fold, fold_reference


def _inputs(device: str, m=300, n=257, r=8, wdtype=torch.bfloat16, adtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(m, n, generator=g).to(device=device, dtype=wdtype)
    a = (torch.randn(r, n, generator=g) * 0.1).to(device=device, dtype=adtype)
    b = (torch.randn(m, r, generator=g) * 0.1).to(device=device, dtype=adtype)
    return w, a, b


def test_cpu_fold_rounds_once():
    w, a, b = _inputs("cpu")
    got = fold(w, a, b, 2.0)
    exact = (w.double() + 2.0 * (b.double() @ a.double())).to(torch.bfloat16)
    # one rounding of an fp32 sum: at most one bf16 ulp from the correctly rounded fp64 result
    ulp = (exact.float().abs() * 2**-7).clamp_min(2**-126)
    assert ((got.float() - exact.float()).abs() <= ulp).all()
    out = torch.empty_like(w)
    assert fold(w, a, b, 2.0, out=out) is out and torch.equal(out, got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("r", [8, 16, 32, 128])
@pytest.mark.parametrize("adtype", [torch.float32, torch.bfloat16])
def test_triton_fold_matches_reference(r, adtype):
    w, a, b = _inputs("cuda", m=1000, n=777, r=r, adtype=adtype)
    got = fold(w, a, b, 0.5)
    ref = fold_reference(w, a, b, 0.5)
    # both accumulate in fp32 but in different orders (and tf32 splits), so allow one bf16 ulp of the
    # larger term: near-cancelling sums can round to different neighbours
    delta = (b.float() @ a.float()).abs() * 0.5
    ulp = (torch.maximum(w.float().abs(), delta) * 2**-7).clamp_min(2**-126)
    assert ((got.float() - ref.float()).abs() <= ulp).all()
    assert (got == ref).float().mean() > 0.99
