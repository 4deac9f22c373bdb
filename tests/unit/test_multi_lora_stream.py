"""Streaming groups into training (backends/multi_lora.py): an adapter's batch fed in units of whole prompt groups,
over several train calls, ends where the same batch fed whole ends — the same 1 / global-batch scaling, gradients
held in the slot until the batch is in, one optimizer step exactly when it fills — at data parallel 1 and 2 (two
ranks in threads, their gradients summed by a stand-in for the trainer's process group). A retired adapter's
partly accumulated batch goes with its slot; a unit that would overshoot the batch is refused.

Tolerance: the factors equal within 5e-6 absolute (they reach 0.16 after three steps; measured 1.2e-6 at data 1 and
1.0e-6 at data 2), the loss and KL within 1e-6, the pre-clip gradient norm within 1e-5 (which a wrong 1 / unit
scaling would miss by a factor: AdamW alone would hide it) — the units pad and split into micro-batches (and DP
shares) differently from the whole batch, so the fp32 sums run in another order; nothing else differs.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.backends.data_parallel import DataParallel
from kora_trainer.backends.multi_lora import MultiLoRATrainer
from kora_trainer.backends.torch_backend import TorchBackend
from kora_trainer.config import load_config
from kora_trainer.config.adapter_runs import AdapterSettings, resolve
from kora_trainer.config.sections import AdapterRunConfig, DataSpec
from tinymodel import make_tiny_model

GROUPS, G = 4, 4  # rolloutBatchSize, nSamplesPerPrompt
TOL = 5e-6
PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 9, 13, 3, 14], [1, 4, 13, 6, 14], [1, 5, 5, 13, 7, 14]]
RESPONSES = [[5, 6, 7, 2], [8, 8, 8, 2], [5, 6, 2], [9, 2], [3, 3, 2], [4, 5, 6, 2], [12, 2], [7, 2]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def trainer(model_dir, dp: int = 1) -> MultiLoRATrainer:
    overrides = [f"model.path={model_dir}", "data.path=unused.parquet", "lora.rank=4", "lora.alpha=8",
                 "lora.dropout=0.0", "lora.syncMode=Adapter", "algorithm.lr=0.02", "algorithm.klCoef=0.05",
                 f"algorithm.rolloutBatchSize={GROUPS}", f"algorithm.nSamplesPerPrompt={G}",
                 f"algorithm.globalBatchSize={GROUPS * G}", f"parallelism.data={dp}", "multiLora.maxAdapters=2",
                 "rollout.engine=hf"]
    cfg, _ = load_config(None, overrides)
    # micro-batches of 3 cut across the groups: units and the whole batch split differently
    return MultiLoRATrainer(TorchBackend(cfg, device="cpu", threads=1, micro_batch_size=3))


def settings(t: MultiLoRATrainer, name: str, stream_groups: int | None) -> AdapterSettings:
    config = AdapterRunConfig(rank=4, seed=3, data=DataSpec(path="unused.parquet"), stream_groups=stream_groups,
                             num_steps=10)
    return resolve(t.backend.cfg, name, config, slot=len(t.adapters))


def batch(t: MultiLoRATrainer, name: str, step: int) -> RolloutBatch:
    """A step's rollouts: GROUPS prompts x G responses, log-probs from the adapter, rewards varying by step."""
    prompts = [PROMPTS[k // G] for k in range(GROUPS * G)]
    responses = [RESPONSES[(k + step) % len(RESPONSES)] for k in range(GROUPS * G)]
    rewards = [float((k * 7 + step) % 3 == 0) for k in range(GROUPS * G)]
    logp = t.logprobs(name, prompts, responses)
    return RolloutBatch(prompts, responses, logp, rewards, G, [str(t.adapters[name].step)] * len(prompts))


def factors(t: MultiLoRATrainer, name: str) -> dict[str, torch.Tensor]:
    return {n: x.detach().clone() for n, x in t.adapter_named(name)}


def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def stream(t: MultiLoRATrainer, name: str, whole: RolloutBatch, per_call: list[int]) -> list:
    """Feed `whole` in calls of per_call[i] groups; the steps the calls returned."""
    out, lo = [], 0
    for groups in per_call:
        out += t.train({name: whole.rows(lo, lo + groups * G)})
        lo += groups * G
    return out


def test_units_over_several_calls_end_where_the_whole_batch_ends(model_dir):
    t = trainer(model_dir)
    t.add(settings(t, "whole", GROUPS))
    t.add(settings(t, "units", None))  # default: the fewest groups that split over the ranks (1 at data 1)
    assert t.adapters["units"].settings.stream_groups == 1 and t.adapters["whole"].settings.stream_groups == GROUPS
    assert gap(factors(t, "whole"), factors(t, "units")) == 0.0  # one seed, one init
    for step in (1, 2, 3):
        ref = t.train({"whole": batch(t, "whole", step)})
        b = batch(t, "units", step)
        got = stream(t, "units", b, [1, 2])  # 3 of 4 groups in: no step yet, the gradients wait in the slot
        assert got == [] and t.pending("units") == 3 * G and t.adapters["units"].step == step - 1
        got = stream(t, "units", b.rows(3 * G, GROUPS * G), [1])
        assert [m.step for m in got] == [step] and t.pending("units") == 0
        assert abs(got[0].loss - ref[0].loss) < 1e-6 and got[0].reward_mean == ref[0].reward_mean
        assert got[0].samples == ref[0].samples == GROUPS * G
        assert abs(got[0].kl - ref[0].kl) < 1e-6 and abs(got[0].grad_norm - ref[0].grad_norm) < 1e-5
    moved = factors(t, "whole")
    assert max(float(x.abs().max()) for k, x in moved.items() if "lora_B" in k) > 1e-3, "nothing moved"
    assert gap(moved, factors(t, "units")) < TOL


def test_a_retired_adapter_drops_its_partial_batch_and_overshoot_is_refused(model_dir):
    t = trainer(model_dir)
    t.add(settings(t, "a", None))
    b = batch(t, "a", 1)
    assert t.train({"a": b.rows(0, 2 * G)}) == [] and t.pending("a") == 2 * G
    with pytest.raises(ValueError, match="do not fit its batch"):
        t.train({"a": b})  # 2 + 4 groups > its 4
    with pytest.raises(ValueError, match="whole groups"):
        t.train({"a": b.rows(0, G - 1)})
    t.drop_pending("a")  # its generation aborted: the batch starts again, clean
    assert t.pending("a") == 0 and all(p.grad is None for p in t.adapters["a"].slot.params)
    assert t.train({"a": b.rows(0, 3 * G)}) == [] and t.pending("a") == 3 * G
    t.remove("a")  # retired mid-batch: its slot, optimizer and the three groups' gradients go
    t.add(settings(t, "a", None))  # the name registered again: a fresh slot, nothing pending
    fresh = trainer(model_dir)
    fresh.add(settings(fresh, "a", None))
    assert t.pending("a") == 0 and all(p.grad is None for p in t.adapters["a"].slot.params)
    t.train({"a": batch(t, "a", 1)})
    fresh.train({"a": batch(fresh, "a", 1)})
    assert gap(factors(t, "a"), factors(fresh, "a")) == 0.0


class ThreadGroup:
    """The trainer's process group for ranks that are threads of one process: sums and maxes in place."""

    device = torch.device("cpu")

    def __init__(self, size: int):
        self.barrier, self.lock = threading.Barrier(size), threading.Lock()
        self.parts: list[torch.Tensor] = []

    def _reduce(self, t: torch.Tensor, op) -> None:
        with self.lock:
            self.parts.append(t.clone())
        self.barrier.wait()
        out = op(torch.stack(self.parts), 0)
        self.barrier.wait()  # every rank has read the parts
        with self.lock:
            self.parts.clear()
        self.barrier.wait()
        t.copy_(out)

    def allreduce_sum(self, t: torch.Tensor) -> None:
        self._reduce(t, torch.sum)

    def allreduce_max(self, t: torch.Tensor) -> None:
        self._reduce(t, lambda x, d: torch.amax(x, d))


def fed(t: MultiLoRATrainer, step: int, done: dict[int, list], r: int) -> None:
    """One rank's train calls: its batch in calls of 1, 1 and 2 groups."""
    done[r] = stream(t, "a", batch(t, "a", step), [1, 1, 2])


def test_units_at_data_2_end_where_the_whole_batch_at_data_1_ends(model_dir):
    """Each rank its share of every unit (a unit = 1 group of 4 samples: 2 per rank), the slot's gradients summed
    over the two ranks only when the batch is in."""
    one = trainer(model_dir)
    one.add(settings(one, "a", GROUPS))
    ranks, group = [trainer(model_dir, dp=2) for _ in range(2)], ThreadGroup(2)
    for r, t in enumerate(ranks):
        t.backend.dp = DataParallel(r, 2, group)  # type: ignore[arg-type]
        t.add(settings(t, "a", None))
        assert t.adapters["a"].settings.stream_groups == 1  # 4 samples a group split over 2 ranks
    for step in (1, 2):
        ref = one.train({"a": batch(one, "a", step)})
        done: dict[int, list] = {}
        threads = [threading.Thread(target=fed, args=(ranks[r], step, done, r)) for r in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert [m.step for m in done[0]] == [m.step for m in done[1]] == [step]
        assert abs(done[0][0].loss - ref[0].loss) < 1e-6
    assert gap(factors(ranks[0], "a"), factors(ranks[1], "a")) == 0.0  # the replicas agree
    assert gap(factors(one, "a"), factors(ranks[0], "a")) < TOL
