"""The colocated fast path (sync/fast/colocated.py + the reference engine's /kora/colocated routes) against a real
`reference_engine` process on the same host: after the HTTP path's first push the trainer maps the engine's memory
once (shared memory here, CUDA IPC on a GPU) and writes every later push straight into it, in Merge, Adapter and
EngineMerge mode; the engine serves the trainer's policy, rollouts carry the version, delta-skip and checksums keep
their meaning. The engine's side holds its weight lock only between a Merge begin and its push, gives it back on abort,
and takes the weights as torn when the writer does not come back within its lease. An engine without the routes
(as SGLang) keeps the job on the HTTP path, with the reason.

Tolerance: ATOL from engine_helpers (fp32 on both sides; only summation order differs).
"""

from __future__ import annotations

import threading

import pytest

from engine_helpers import (
    ATOL,
    colocated_sender,
    kora_and_sglang_like,
    logprob_gap,
    step,
    trained_policy,
    wait_engine_state,
)
from kora_trainer.lora import adapter_tensors
from kora_trainer.sync.sender import POLICY_ADAPTER
from kora_trainer.wire.engine_client import EngineError
from kora_trainer.wire.protocol import checksum

pytestmark = pytest.mark.timeout(240)
CAP = "64Ki"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with kora_and_sglang_like(tmp_path_factory) as up:
        yield up


@pytest.mark.parametrize(("mode", "seed"), [("Merge", 41), ("Adapter", 42), ("EngineMerge", 44)])
def test_colocated_fast_path_writes_the_policy_into_the_engine(served, mode, seed):
    model_dir, engine = served[0], served[1]["kora"]
    b = trained_policy(model_dir, mode, seed, CAP)
    lora_path = POLICY_ADAPTER if mode == "Adapter" else None
    with engine.client() as client:
        sender = colocated_sender(b, client)
        first = sender.sync(version=1)
        assert first.pushed and first.path == "http" and first.note.startswith("fast path on (colocated"), first.note
        assert logprob_gap(client, b, lora_path) < ATOL
        for version in (2, 3, 4, 5):  # past the adapter ring's 3 slots: every slot rewritten once
            step(b, 0.05 if version % 2 else -0.04)
            assert logprob_gap(client, b, lora_path) > 1e-2  # stale until the push
            report = sender.sync(version=version)
            assert report.pushed and report.path == "fast" and report.transport == "colocated"
            assert report.adapter_version == version and report.bytes > 0 and report.ms > 0
            assert report.what == {"Adapter": "adapter", "EngineMerge": "lora_pairs",
                                   "Merge": "adapted"}[mode]
            assert logprob_gap(client, b, lora_path) < ATOL
            out = client.generate([[1, 4, 5]], {"max_new_tokens": 1}, lora_path=lora_path)
            assert out[0].weight_version == str(version)  # rollouts carry the version written
        if mode != "Merge":  # every push checked: the HTTP path's definition of the pairs' checksum
            assert report.checksum == checksum(adapter_tensors(b.model))
        skipped = sender.sync(version=6)
        assert not skipped.pushed and skipped.what == "skipped" and skipped.adapter_version == 5


def test_an_engine_without_the_routes_keeps_the_http_path(served):
    model_dir, sglang_like = served[0], served[1]["sglang_like"]
    b = trained_policy(model_dir, "Adapter", 43, CAP)
    with sglang_like.client() as client:
        sender = colocated_sender(b, client)
        first = sender.sync(version=1)
        assert first.path == "http" and "HTTP 404" in first.note and "HTTP path stays" in first.note, first.note
        step(b)
        report = sender.sync(version=2)
        assert report.pushed and report.path == "http" and report.transport == "colocated"
        assert logprob_gap(client, b, POLICY_ADAPTER) < ATOL


def test_a_merge_write_holds_the_weights_only_until_its_push_or_abort(served):
    """begin takes the engine's weight lock (a generation waits), push and abort give it back; a second begin
    while one holds it, a push without a begin and an unknown name are refused with a 400 naming the fix."""
    with served[1]["kora"].client() as client:
        client.colocated("plan", {"mode": "Merge"})
        client.colocated("begin", {"lease_s": 30})
        with pytest.raises(EngineError) as again:
            client.colocated("begin", {})
        assert again.value.status == 400 and "already holds the weights" in again.value.message
        done = threading.Event()
        gen = threading.Thread(target=lambda: (client.generate([[1, 2]], {"max_new_tokens": 1}), done.set()))
        gen.start()
        wait_engine_state(client, "the generation admitted", in_flight=1)
        assert not done.is_set(), "a generation ran while a Merge write held the weights"
        client.colocated("abort", {})
        assert done.wait(30), "the generation did not run after the abort gave the weights back"
        gen.join()
        client.colocated("begin", {})
        with pytest.raises(EngineError) as unknown:
            client.colocated("push", {"weight_version": "7", "names": ["no.such.weight"]})
        assert unknown.value.status == 400 and "no.such.weight" in unknown.value.message
        assert client.generate([[1, 2]], {"max_new_tokens": 1})[0].output_ids  # the refused push gave it back
        with pytest.raises(EngineError) as orphan:
            client.colocated("push", {"weight_version": "8"})
        assert orphan.value.status == 400 and "POST /kora/colocated/begin first" in orphan.value.message
        assert client.colocated("abort", {}) == {"success": True, "released": False}


def test_a_writer_that_never_pushes_loses_the_weights_as_torn(served):
    with served[1]["kora"].client() as client:
        client.colocated("plan", {"mode": "Merge"})
        client.colocated("begin", {"lease_s": 0.5})
        out = client.generate([[1, 2]], {"max_new_tokens": 1})  # runs once the lease has run out
        assert out[0].weight_version == "torn"
        with pytest.raises(EngineError) as late:
            client.colocated("push", {"weight_version": "9", "names": []})
        assert late.value.status == 400 and "lease ran out" in late.value.message
        client.update_weight_version("default")


def test_a_plan_for_another_mode_is_refused(served):
    with served[1]["kora"].client() as client:
        with pytest.raises(EngineError) as bad_mode:
            client.colocated("plan", {"mode": "Bogus"})
        assert bad_mode.value.status == 400 and "Merge, Adapter or EngineMerge" in bad_mode.value.message


def test_a_weight_write_waits_one_step_not_the_generation_in_flight(served):
    """Issue 17 item 2: a Merge write waits for the next step boundary of a generation in flight, not for its end;
    the generation then goes on under the new weights and reports the version it started under (the oldest that
    served it, so the trainer never takes it for on-policy)."""
    with served[1]["kora"].client() as client:
        client.colocated("plan", {"mode": "Merge"})
        client.update_weight_version("before")
        outs: list = []
        params = {"max_new_tokens": 240, "temperature": 0.0, "ignore_eos": True}
        gen = threading.Thread(target=lambda: outs.extend(client.generate([[1, 2 + i] for i in range(8)], params)))
        gen.start()
        wait_engine_state(client, "the long generation admitted", in_flight=8)
        client.colocated("begin", {"lease_s": 60})  # returns within one decode step of the generation
        held = not outs  # still generating: it gave the weights up mid-way
        client.colocated("push", {"weight_version": "after", "names": []})
        gen.join(120)
        assert held, "the write waited for the whole generation in flight"
        assert [len(o.output_ids) for o in outs] == [240] * 8
        assert {o.weight_version for o in outs} == {"before"}  # it spanned the write: the version it started under
        assert client.generate([[1, 2]], {"max_new_tokens": 1})[0].weight_version == "after"
        client.update_weight_version("default")
