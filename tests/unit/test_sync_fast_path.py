"""The fast path of weight sync (sync/fast/distributed.py + the reference engine's /kora/fast_sync routes) against real
`reference_engine` processes over a real gloo group: after the HTTP path's first push it plans once, then pushes in
Merge and Adapter mode, and the engine serves the trainer's policy; delta-skip, versions and checksums keep the
HTTP path's meaning. Where it cannot run (an engine without the routes, as SGLang; a policy the plan does not
cover) the job stays on the HTTP path, with the reason in the report.

Tolerance: ATOL from engine_helpers (fp32 on both sides; only summation order differs).
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import ATOL, kora_and_sglang_like, logprob_gap, on_hf_engines, step, trained_policy
from kora_trainer.lora import adapter_tensors
from kora_trainer.sync.fast.distributed import FastWeightSender
from kora_trainer.sync.fast.path import fast_path_off, with_fast_path
from kora_trainer.sync.sender import POLICY_ADAPTER, WeightSender
from kora_trainer.sync.transport import DistributedTransport
from kora_trainer.wire.protocol import PackedChecksum, checksum

CAP = "64Ki"  # several buckets (the tiny model is ~300 kB), every folded weight (<= 32 kB) fits one


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with kora_and_sglang_like(tmp_path_factory) as up:
        yield up


def fast_sender(b, client):
    on_hf_engines(b)
    http = WeightSender(b.model, b.cfg, DistributedTransport.connect([client], backend="gloo"))
    assert fast_path_off(http, b.cfg) is None
    sender = with_fast_path(http, b.cfg)
    assert isinstance(sender, FastWeightSender)
    return sender



@pytest.mark.parametrize(("mode", "seed"), [("Merge", 31), ("Adapter", 32)])
def test_fast_path_pushes_the_policy_after_the_first_http_push(served, mode, seed):
    model_dir, engine = served[0], served[1]["kora"]
    b = trained_policy(model_dir, mode, seed, CAP)
    lora_path = POLICY_ADAPTER if mode == "Adapter" else None
    with engine.client() as client:
        sender = fast_sender(b, client)
        try:
            first = sender.sync(version=1)
            assert first.pushed and first.path == "http" and first.note.startswith("fast path on"), first.note
            assert logprob_gap(client, b, lora_path) < ATOL
            flat = sender.flat
            assert flat is not None and all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                                            for p in b.params)  # one buffer, the same parameters
            step(b)
            assert logprob_gap(client, b, lora_path) > 1e-2  # stale until the next push
            report = sender.sync(version=2)
            assert report.pushed and report.path == "fast" and report.adapter_version == 2
            assert report.what == ("full" if mode == "Merge" else "adapter") and report.bytes > 0
            assert report.buckets > (1 if mode == "Merge" else 0) and report.ms > 0
            # a verified push (the first fast one): the engine's checksum of what it applied matched; the reported
            # one is protocol.checksum's, the HTTP path's definition
            assert report.checksum is not None
            if mode == "Adapter":
                assert report.checksum == checksum(adapter_tensors(b.model))
            assert logprob_gap(client, b, lora_path) < ATOL
            out = client.generate([[1, 4, 5]], {"max_new_tokens": 1}, lora_path=lora_path)
            assert out[0].weight_version == "2"  # rollouts are tagged with the version pushed
            skipped = sender.sync(version=3)  # nothing moved: delta-skip, as on the HTTP path
            assert not skipped.pushed and skipped.what == "skipped" and skipped.adapter_version == 2
            step(b, -0.03)
            again = sender.sync(version=4)  # not a verified push: Merge reports no checksum, Adapter its own
            assert again.pushed and again.path == "fast" and again.max_delta == pytest.approx(0.03, rel=1e-3)
            assert (again.checksum is None) if mode == "Merge" else again.checksum == checksum(adapter_tensors(b.model))
            assert logprob_gap(client, b, lora_path) < ATOL
        finally:
            sender.close()


def test_an_engine_without_the_routes_keeps_the_http_path(served):
    model_dir, sglang_like = served[0], served[1]["sglang_like"]
    b = trained_policy(model_dir, "Adapter", 33, CAP)
    with sglang_like.client() as client:
        sender = fast_sender(b, client)
        try:
            first = sender.sync(version=1)
            assert first.pushed and first.path == "http"
            assert "HTTP 404" in first.note and "HTTP path stays" in first.note, first.note
            assert not sender.active and "404" in (sender.fallback_reason or "")
            step(b)
            report = sender.sync(version=2)
            assert report.pushed and report.path == "http" and report.what == "adapter" and report.checksum
            assert logprob_gap(client, b, POLICY_ADAPTER) < ATOL
        finally:
            sender.close()


def test_a_policy_the_plan_does_not_cover_keeps_the_http_path(served):
    """Merge with a bucket smaller than a folded weight: the HTTP path splits it, the fast path's fold cannot."""
    model_dir, engine = served[0], served[1]["kora"]
    b = trained_policy(model_dir, "Merge", 34, "24Ki")
    before = [p.data_ptr() for p in b.params]
    with engine.client() as client:
        sender = fast_sender(b, client)
        try:
            first = sender.sync(version=1)
            assert first.path == "http" and "does not fit in sync.bufferSize" in first.note, first.note
            assert [p.data_ptr() for p in b.params] == before  # refused before the parameters were touched
            step(b)
            assert sender.sync(version=2).path == "http"
            assert logprob_gap(client, b, None) < ATOL
        finally:
            sender.close()


def test_packed_checksum_equals_the_per_tensor_checksum():
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
             ("empty", torch.zeros(0, 4)), ("c", torch.randn(2, 3, 4, generator=g)),
             ("long", torch.randn(17_000_000, generator=g))]  # > one 2^24-word chunk of the fingerprint
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])
    packed = PackedChecksum([(n, t.dtype, t.shape) for n, t in named])
    assert packed.exact and packed(flat) == checksum(named)
    odd = [("u8", torch.arange(3, dtype=torch.uint8)), ("f", torch.randn(4, generator=g))]
    packed = PackedChecksum([(n, t.dtype, t.shape) for n, t in odd])  # odd bytes: the per-tensor form
    assert not packed.exact and packed(torch.cat([t.reshape(-1).view(torch.uint8) for _, t in odd])) == checksum(odd)
