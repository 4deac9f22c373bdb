"""bench/gpu_sync.py's GPU placement for `--tp T --engines N`: TP ranks on GPUs 0..T-1, engines after them; with
too few GPUs the engines wrap onto the trainer's GPUs but never onto GPU 0 and never two onto one GPU (TP rank 0
and the engines are ranks of one NCCL communicator: one rank per GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from gpu_sync import engine_gpus


@pytest.mark.parametrize(("tp", "engines", "ngpus", "gpus"), [
    (1, 1, 2, [1]),  # today's two-GPU run
    (2, 2, 4, [2, 3]),  # issue 8's layout
    (2, 1, 3, [2]),
    (1, 0, 1, []),  # --no-engine
])
def test_engines_after_the_trainer_when_there_is_room(tp, engines, ngpus, gpus):
    assert engine_gpus(tp, engines, ngpus) == (gpus, None)


@pytest.mark.parametrize(("tp", "engines", "ngpus", "gpus", "shared"), [
    (2, 1, 2, [1], [1]),  # the two-GPU machine: the engine beside TP rank 1
    (2, 2, 3, [2, 1], [1]),
    (3, 2, 3, [1, 2], [1, 2]),
])
def test_too_few_gpus_wraps_onto_trainer_gpus_but_not_gpu0(tp, engines, ngpus, gpus, shared):
    got, warning = engine_gpus(tp, engines, ngpus)
    assert got == gpus and warning is not None and f"GPU(s) {shared}" in warning


@pytest.mark.parametrize(("tp", "engines", "ngpus"), [(2, 2, 2), (1, 2, 2), (1, 1, 1), (3, 1, 2)])
def test_impossible_layouts_fail_early(tp, engines, ngpus):
    with pytest.raises(ValueError, match="GPU"):
        engine_gpus(tp, engines, ngpus)


def test_every_layout_gives_distinct_gpus_other_than_0():
    for ngpus in range(1, 9):
        for tp in range(1, ngpus + 1):
            for engines in range(0, 9):
                try:
                    gpus, warning = engine_gpus(tp, engines, ngpus)
                except ValueError:
                    assert engines > ngpus - 1  # only when there are not enough GPUs besides GPU 0
                    continue
                assert len(gpus) == engines == len(set(gpus)) and 0 not in gpus
                assert all(0 < g < ngpus for g in gpus) and (warning is None) == (tp + engines <= ngpus)
