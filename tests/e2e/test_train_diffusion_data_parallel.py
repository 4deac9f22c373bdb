"""A diffusion job on data-parallel ranks through the train command (issue 23): `parallelism.data=2` starts two
Ray rank actors, each holding the toy's transformer FSDP2-sharded over a gloo group on 127.0.0.1, and trains the
run that `parallelism.data=1` (one process, no Ray) trains.

- Two ranks = one rank: every step's loss and reward, and the adapter after the last step, agree with the one-rank
  run's within TOLERANCE (the ranks average their gradients in FSDP2's reduce-scatter: the same update up to the
  order of float sums, which Adam's g / sqrt(v) magnifies a little for near-zero gradients), and the engine serves
  every pushed policy (the serving check's gap < 1e-5).
- The checkpoint does not depend on the rank count (the adapter and the optimizer state gathered whole): the
  two-rank run's step-2 checkpoint resumed by one rank continues with the one-rank run's steps 3-4, and (`-m full`)
  the one-rank run's resumed by two ranks does too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_train_diffusion import STEPS, adapter, curve, run

from trainkit import TrainRun, wait_all

# largest |difference| of a step's loss or reward, two ranks vs one (measured 1.7e-7), and of an adapter element
# after the last step (measured 9.8e-7, up to 7.1e-6 with one optimizer step a step: Adam's g / sqrt(v) magnifies
# the rounding of near-zero gradients; the elements move by up to 2.9e-2 over these steps)
TOLERANCE = 1e-5
ADAPTER_TOLERANCE = 5e-5


def trained(toy: Path, work: Path, data: int, *overrides: str) -> TrainRun:
    """4 prompt groups of 4 a step in two optimizer steps (globalBatchSize 8): at data 2 each rank takes one group
    of each optimizer step's two (fsdp.rank_rows)."""
    r = run(toy, work, "lora.syncMode=EngineMerge", "algorithm.globalBatchSize=8", f"parallelism.data={data}",
            f"algorithm.numSteps={STEPS}",
            "checkpoint.interval=1", f"checkpoint.keep={STEPS}", f"checkpoint.path={work / 'ckpt'}", *overrides)
    wait_all([r])
    return r


@pytest.fixture(scope="module")
def one_and_two(diffusion_toy_dir, tmp_path_factory):
    """The same job at parallelism.data 1 and 2, 4 steps each, a checkpoint every step."""
    work = tmp_path_factory.mktemp("diffusion-dp")
    return (trained(diffusion_toy_dir, work / "data1", 1), work / "data1" / "ckpt",
            trained(diffusion_toy_dir, work / "data2", 2), work / "data2" / "ckpt")


def assert_close(want: list[tuple[int, float, float]], got: list[tuple[int, float, float]]) -> float:
    """Same steps, each loss and reward within TOLERANCE; the largest difference."""
    assert [s for s, _, _ in got] == [s for s, _, _ in want], (want, got)
    diff = max(max(abs(a[1] - b[1]), abs(a[2] - b[2])) for a, b in zip(want, got, strict=True))
    assert diff < TOLERANCE, (diff, want, got)
    return diff


def adapter_diff(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    assert want.keys() == got.keys() and len(want) == 30
    return max(float((want[k] - got[k]).abs().max()) for k in want)


def test_two_data_parallel_ranks_train_the_one_rank_run(one_and_two):
    one, one_ckpt, two, two_ckpt = one_and_two
    for r, world in ((one, 1), (two, 2)):
        assert r.summary()["steps"] == STEPS
        start = r.events("start")[0]
        assert start["world"] == world, start
        steps = r.events("step")
        assert all(e["rollout_logp_gap_max"] < 1e-5 for e in steps), [e["rollout_logp_gap_max"] for e in steps]
        assert all(e["sync"]["pushed"] and e["sync"]["what"] == "lora_pairs" for e in steps)
    assert [r["rank"] for r in two.events("start")[0]["ranks"]] == [0, 1]
    want, got = curve(one), curve(two)
    diff = assert_close(want, got)
    assert want[-1][2] != want[0][2]  # it trained: the rewards moved
    moved = adapter_diff(adapter(one_ckpt, 1), adapter(one_ckpt, STEPS))
    final = adapter_diff(adapter(one_ckpt, STEPS), adapter(two_ckpt, STEPS))
    print(f"two ranks vs one: largest loss/reward difference {diff:.3g}, adapter {final:.3g} "
          f"(the adapter moved up to {moved:.3g} from step 1 to {STEPS})")
    assert final < ADAPTER_TOLERANCE < moved / 100


def resumed(toy: Path, work: Path, ckpt: Path, data: int) -> TrainRun:
    """A run at `data` ranks on a copy of `ckpt`'s step-2 checkpoint alone: resumes there, runs steps 3-4."""
    root = work / "ckpt"
    root.mkdir(parents=True)
    shutil.copytree(ckpt / "step_00000002", root / "step_00000002")
    r = trained(toy, work, data)
    assert r.summary()["resumed_from_step"] == 2 and r.events("resume")[0]["step"] == 2
    return r


def test_a_two_rank_checkpoint_resumes_on_one_rank(one_and_two, diffusion_toy_dir, tmp_path):
    one, one_ckpt, _, two_ckpt = one_and_two
    r = resumed(diffusion_toy_dir, tmp_path, two_ckpt, 1)
    diff = assert_close(curve(one)[2:], curve(r))
    final = adapter_diff(adapter(one_ckpt, STEPS), adapter(tmp_path / "ckpt", STEPS))
    print(f"two ranks to step 2, one rank on: largest loss/reward difference {diff:.3g}, adapter {final:.3g}")
    assert final < ADAPTER_TOLERANCE


@pytest.mark.full
def test_a_one_rank_checkpoint_resumes_on_two_ranks_and_two_ranks_resume_exactly(one_and_two, diffusion_toy_dir,
                                                                                 tmp_path):
    one, one_ckpt, two, two_ckpt = one_and_two
    r = resumed(diffusion_toy_dir, tmp_path / "from1", one_ckpt, 2)
    diff = assert_close(curve(one)[2:], curve(r))
    final = adapter_diff(adapter(one_ckpt, STEPS), adapter(tmp_path / "from1" / "ckpt", STEPS))
    print(f"one rank to step 2, two ranks on: largest loss/reward difference {diff:.3g}, adapter {final:.3g}")
    assert final < ADAPTER_TOLERANCE
    same = resumed(diffusion_toy_dir, tmp_path / "from2", two_ckpt, 2)
    assert curve(same) == curve(two)[2:]  # the same rank count: exact, to the last bit
    want, got = adapter(two_ckpt, STEPS), adapter(tmp_path / "from2" / "ckpt", STEPS)
    assert all(torch.equal(want[k], got[k]) for k in want)
