"""The delta decision fused with the ring slot's gather (kernels/gather_delta.py): the number a push decides on
and the bytes it writes. The Triton kernel runs here through Triton's interpreter (on CPU), and on a GPU if any."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kora_trainer.kernels.gather_delta import gather, gather_max_delta, runs_of
from kora_trainer.sync.fast.adapter_pack import FlatDelta

ROOT = Path(__file__).resolve().parents[2]


def _case(n_src=5000, n_out=7000, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(n_src, generator=g).to(torch.bfloat16)
    index = torch.randint(0, n_src, (n_out,), generator=g, dtype=torch.int32)  # repeats, as shared lora_A reads
    last = torch.randn(n_out, generator=g)
    return src.to(device), index.to(device), last.to(device)


def _expected(src, index, last):
    values = src if index is None else src[index.long()]
    return values, float((values.float() - last).abs().max())


@pytest.mark.parametrize("with_index", [True, False])
def test_the_number_is_the_largest_change_and_the_gather_lands_in_order(with_index):
    src, index, last = _case()
    if not with_index:
        index, last = None, last[:src.numel()]
    out = torch.empty(last.numel(), dtype=torch.bfloat16)
    result = torch.zeros(1)
    gather_max_delta(src, index, last, result, out)
    values, want = _expected(src, index, last)
    assert float(result) == want
    assert torch.equal(out, values)


def test_a_nan_in_the_adapter_is_pushed_and_nothing_changed_is_zero():
    src, index, _ = _case()
    last = torch.empty(index.numel())
    gather(src, index, last)  # what was pushed, in the pack's order, fp32
    result = torch.full((1,), 7.0)
    gather_max_delta(src, index, last, result)
    assert float(result) == 0.0
    src[int(index[5])] = float("nan")
    gather_max_delta(src, index, last, result)
    assert float(result) == float("inf")  # a NaN maximum would compare False against the threshold: a skip


def test_bad_shapes_are_refused_naming_what_is_wrong():
    src, index, last = _case()
    with pytest.raises(ValueError, match="one entry per run of 1"):
        gather_max_delta(src, index[:-1], last, torch.zeros(1))
    with pytest.raises(ValueError, match="float tensor"):
        gather_max_delta(src, index, last.int(), torch.zeros(1))
    with pytest.raises(ValueError, match="one length"):
        gather_max_delta(src, None, last, torch.zeros(1))


def test_an_index_of_whole_rows_shrinks_to_its_row_starts():
    """An adapter's HF rows are runs of consecutive elements: the index is read once per run, same gather."""
    src = torch.randn(10_000, dtype=torch.bfloat16)
    rows = torch.tensor([7, 3, 3, 150, 0], dtype=torch.int32)  # rows of 32 (row 3 read twice, as a shared lora_A)
    index = (rows.unsqueeze(1) * 32 + torch.arange(32, dtype=torch.int32)).view(-1)
    starts, run = runs_of(index, longest=64)
    assert run == 32 and torch.equal(starts, rows * 32)
    assert runs_of(index[1:])[1] == 1  # no run fits an index cut mid-row
    last = torch.zeros(index.numel(), dtype=torch.bfloat16)  # the previous ring slot, in the source's dtype
    out, result = torch.empty_like(last), torch.zeros(1)
    gather_max_delta(src, starts, last, result, out, run)
    assert torch.equal(out, src[index.long()]) and float(result) == float(src[index.long()].float().abs().max())
    with pytest.raises(ValueError, match="one entry per run of 32"):
        gather_max_delta(src, starts[:-1], last, result, out, run)


def test_flat_delta_skips_what_did_not_move():
    flat = torch.randn(100, dtype=torch.bfloat16)
    delta = FlatDelta(flat)
    assert delta.should_push(flat, 0.0) == (True, float("inf"))  # before the first push
    delta.mark_pushed(flat)
    assert delta.should_push(flat, 0.0) == (False, 0.0)
    before = float(flat[91])
    flat[91] += 0.5
    push, value = delta.should_push(flat, 1e-3)
    assert push and value == abs(float(flat[91]) - before)


_INTERPRETED = r"""
import json, sys, torch
sys.path[:0] = sys.argv[1:]
from kora_trainer.kernels import gather_delta as g
from test_gather_delta_kernel import _case, _expected
out = {}
cases = [("index32", True, torch.int32), ("index64", True, torch.int64), ("flat", False, None), ("runs", True, None)]
for name, with_index, dtype in cases:
    src, index, last = _case(n_src=9000, n_out=9000 if not with_index else 10001)
    run = 1
    if name == "runs":  # rows of 16 from a bf16 previous slot
        rows = torch.randint(0, 9000 // 16, (640,), dtype=torch.int32)
        index = (rows.unsqueeze(1) * 16 + torch.arange(16, dtype=torch.int32)).view(-1)
        last = torch.randn(index.numel()).to(torch.bfloat16)
        starts, run = g.runs_of(index)
    elif with_index:
        index = index.to(dtype)
    else:
        index = None
    got, res = torch.empty(last.numel(), dtype=torch.bfloat16), torch.zeros(1)
    g._launch(src, starts if run > 1 else index, last, got, res, last.numel(), run)
    values, want = _expected(src, index, last.float())
    values = values.clone()  # the source itself without an index: its NaN below is not the gather's
    fp32 = torch.empty(last.numel())
    g._launch(src, starts if run > 1 else index, None, fp32, None, last.numel(), run)
    src[int(index[3]) if index is not None else 3] = float("nan")
    nan = torch.zeros(1)
    g._launch(src, starts if run > 1 else index, last, None, nan, last.numel(), run)
    out[name] = {"number": float(res), "want": want, "gather": bool(torch.equal(got, values)),
                 "fp32": bool(torch.equal(fp32, values.float())), "nan": float(nan)}
print(json.dumps(out))
"""


def test_the_triton_kernel_gives_the_same_number_and_bytes():
    """The kernel itself (not the torch path), run by Triton's interpreter: the number to the bit, the gather and
    the fp32 copy exact, a NaN read as +inf."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED, str(ROOT / "trainer"), str(ROOT / "tests" / "unit")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, r in json.loads(proc.stdout.splitlines()[-1]).items():
        assert r["number"] == r["want"], name
        assert r["gather"] and r["fp32"], name
        assert r["nan"] == float("inf"), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_replayed_in_a_cuda_graph():
    """Captured once and replayed after the source changed (as `_capture_decide` does): the number and the slot
    follow the source, against torch on the same device."""
    src, index, last = _case(n_src=3_000_000, n_out=4_000_001, device="cuda")
    out, result = torch.empty(index.numel(), dtype=torch.bfloat16, device="cuda"), torch.zeros(1, device="cuda")
    gather_max_delta(src, index, last, result, out)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather_max_delta(src, index, last, result, out)
    for step in range(3):
        src.add_(0.25 * (step + 1))
        graph.replay()
        torch.cuda.synchronize()
        values, want = _expected(src, index, last)
        assert float(result) == want
        assert torch.equal(out, values)
