"""Generation yields an adapter's completed groups as they finish (orchestration/adapter_rollout.py `units`): its
batch goes out as calls of at most streamGroups prompts, and comes back in units of streamGroups groups, scored, in
prompt order whatever order the calls finish in; the last unit says so; an aborted unit ends the batch. No engine:
the rollout manager's spread is a stand-in answering its calls last first."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kora_trainer.config.adapter_runs import AdapterSettings
from kora_trainer.config.sections import DataSpec
from kora_trainer.orchestration.adapter_rollout import AdapterRollouts, _Adapter
from kora_trainer.orchestration.data import Row
from kora_trainer.orchestration.rollout_manager import Rollout
from kora_trainer.wire.engine_client import GenerateOutput

G = 2


class Engines:
    """Rollout.spread's contract: each call's answers to on_chunk (here last call first), then all, in order."""

    cfg = SimpleNamespace(algorithm=SimpleNamespace(max_new_tokens=4, temperature=1.0))
    requests = Rollout.requests
    scored = Rollout.scored

    def __init__(self, abort_prompt: int | None = None, seeded: bool = False):
        self.abort_prompt, self.calls, self.seeded = abort_prompt, [], seeded

    def spread(self, step: int, ids: list[list[int]], params: list[dict[str, Any]], g: int, *, on_chunk: Any,
               chunk_prompts: int | None = None, **kw: Any) -> tuple[list[GenerateOutput], dict[str, str]]:
        self.in_flight = kw.get("in_flight")
        n = len(ids) // g
        chunk_prompts = chunk_prompts or n  # the whole step in one call, as on one engine
        firsts = list(range(0, n, chunk_prompts))
        self.calls = [min(chunk_prompts, n - f) for f in firsts]
        outs = [self.answer(ids[k], k // g) for k in range(len(ids))]
        for f in reversed(firsts):
            on_chunk(f, outs[f * g:(f + chunk_prompts) * g])
        return outs, {}

    def answer(self, prompt: list[int], p: int) -> GenerateOutput:
        aborted = p == self.abort_prompt
        return GenerateOutput(f"{prompt[0]}", [prompt[0], 2], [-0.5, -0.25],
                              {"type": "abort" if aborted else "stop"}, None, len(prompt), {})


def rollouts(engines: Engines, groups: int, stream_groups: int) -> AdapterRollouts:
    r = AdapterRollouts.__new__(AdapterRollouts)
    r.rollout, r.adapters, r.engine_tags = engines, {}, False  # type: ignore[assignment]
    settings = AdapterSettings(name="a", slot=0, rank=4, alpha=8, lr=1e-3, rollout_batch_size=groups,
                               n_samples_per_prompt=G, data=DataSpec(path="unused.parquet"), num_steps=None,
                               num_epochs=None, seed=0, stream_groups=stream_groups)
    rows = [Row(i, f"p{i}", str(i)) for i in range(groups)]
    prompts = SimpleNamespace(build=lambda rs: ([[10 + row.index, 1] for row in rs], None, None))
    r.adapters["a"] = _Adapter(settings, rows, iter([rows]), lambda s: float(s.index % 2), prompts)  # type: ignore
    return r


def test_units_come_in_prompt_order_whatever_order_the_calls_finish():
    engines = Engines()
    got = list(rollouts(engines, groups=5, stream_groups=2).units("a", 1))
    assert engines.calls == [2, 2, 1]  # a call per unit: a unit moves on as soon as its own samples are in
    assert engines.in_flight == 5  # all at once: the engine batches them together
    assert [len(b) for b, _ in got] == [4, 4, 2] and [s["groups"] for _, s in got] == [2, 2, 1]
    assert [s["last"] for _, s in got] == [False, False, True]
    assert [p[0] for b, _ in got for p in b.prompt_ids] == [10, 10, 11, 11, 12, 12, 13, 13, 14, 14]
    assert [b.rewards for b, _ in got] == [[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0], [0.0, 0.0]]
    assert all(s["data_position"] == 1 and b.weight_versions == ["0"] * len(b) for b, s in got)


def test_a_run_claiming_exact_resume_keeps_the_calls_of_a_whole_step():
    """Reproducible rollouts: the engine must batch the same requests together whatever the timing, so the calls
    are cut as for a whole step (one on one engine) and the units of a call move on together."""
    engines = Engines(seeded=True)
    got = list(rollouts(engines, groups=5, stream_groups=2).units("a", 1))
    assert engines.calls == [5] and engines.in_flight is None and [len(b) for b, _ in got] == [4, 4, 2]
    assert [s["last"] for _, s in got] == [False, False, True]


def test_an_aborted_unit_ends_the_batch():
    got = list(rollouts(Engines(abort_prompt=3), groups=6, stream_groups=2).units("a", 1))
    assert [b is None for b, _ in got] == [False, True] and got[-1][1]["aborted"]
