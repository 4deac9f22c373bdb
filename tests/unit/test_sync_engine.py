"""Weight sync against the real reference engine (a separate `reference_engine` process): after a sync in each
mode and over each transport, the engine's log-probs for fixed prompts equal the trainer policy's; without
the sync they differ. Also: buckets stay under the cap with A/B pairs whole, and an unchanged adapter is not
pushed.

Tolerance: both sides run the same fp32 weights; they differ only in summation order (the engine's KV-cache
and padding, a folded W vs x·W + s·(x·A)·B), which moves log-probs by ~1e-6. ATOL = 1e-4 (engine_helpers).
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import ATOL, PROMPTS, logprob_gap, start_engine, stop_engine, trained_policy
from kora_trainer.backends.torch_backend import TorchBackend
from kora_trainer.lora import adapter_tensors, base_state, folded_state
from kora_trainer.sync.sender import POLICY_ADAPTER, WeightSender, colocated_buckets
from kora_trainer.sync.sources import adapter_source, merged_source
from kora_trainer.sync.transport import ColocatedTransport, DistributedTransport
from kora_trainer.wire.protocol import checksum, plan_buckets
from tinymodel import make_tiny_model

CAP = 24 * 1024  # small enough that the tiny model needs many buckets and some tensors get split


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    proc = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "--max-lora-rank", "8")
    yield proc
    stop_engine(proc)


def policy(model_dir, mode: str, seed: int, cap: int = CAP) -> TorchBackend:
    return trained_policy(model_dir, mode, seed, cap)


gap = logprob_gap


def served_version(client, lora_path: str | None) -> str | None:
    """The policy version the engine says it served (meta_info.weight_version): the staleness signal."""
    return client.generate(PROMPTS[:1], {"max_new_tokens": 1}, lora_path=lora_path)[0].weight_version


def expected_push(b: TorchBackend, mode: str) -> list:
    """What the first sync of each mode pushes (the report's checksum covers exactly this)."""
    if mode == "Merge":
        return list(folded_state(b.model))
    if mode == "Adapter":
        return [*base_state(b.model), *adapter_tensors(b.model)]
    return adapter_tensors(b.model)


def transport_for(kind: str, client):
    return DistributedTransport.connect([client], backend="gloo") if kind == "distributed" \
        else ColocatedTransport([client])


@pytest.mark.parametrize("transport", ["distributed", "colocated"])
@pytest.mark.parametrize(("mode", "seed"), [("Merge", 1), ("Adapter", 2), ("EngineMerge", 3)])
def test_engine_serves_the_trained_policy_after_sync(engine, model_dir, mode, seed, transport):
    b = policy(model_dir, mode, seed + (10 if transport == "colocated" else 0))
    lora_path = POLICY_ADAPTER if mode == "Adapter" else None
    with engine.client() as client:
        sender = WeightSender(b.model, b.cfg, transport_for(transport, client))
        try:
            if mode != "Adapter":  # (an adapter that was never loaded cannot be asked for at all)
                assert gap(client, b, lora_path) > 1e-2  # not synced yet: the engine serves something else
            report = sender.sync(version=1)
            assert report.pushed and report.adapter_version == 1 and report.bytes > 0
            assert report.checksum == checksum(expected_push(b, mode))  # every tensor pushed, in push order
            assert gap(client, b, lora_path) < ATOL
            assert served_version(client, lora_path) == "1"  # rollouts are tagged with the version pushed
            if mode == "Adapter":
                assert report.what == "base+adapter"
                # a further step changes the adapter: stale until the next sync, equal after it
                with torch.no_grad():
                    for p in b.params:
                        p.add_(0.05)
                assert gap(client, b, lora_path) > 1e-2
                again = sender.sync(version=2)
                assert again.what == "adapter" and again.bytes < report.bytes
                assert again.checksum == checksum(adapter_tensors(b.model))
                assert gap(client, b, lora_path) < ATOL
                assert served_version(client, lora_path) == "2"
        finally:
            sender.close()


def test_unchanged_adapter_is_not_pushed(engine, model_dir):
    b = policy(model_dir, "Adapter", seed=5)
    with engine.client() as client:
        sender = WeightSender(b.model, b.cfg, transport_for("distributed", client))
        try:
            assert sender.sync(version=1).pushed
            skipped = sender.sync(version=2)
            assert not skipped.pushed and skipped.bytes == 0 and skipped.adapter_version == 1
            assert skipped.max_delta == 0.0
            with torch.no_grad():
                b.params[0].add_(1e-3)  # one tensor moves, above the 1e-6 threshold
            moved = sender.sync(version=3)
            assert moved.pushed and moved.adapter_version == 3 and moved.max_delta == pytest.approx(1e-3, rel=1e-3)
        finally:
            sender.close()


def test_buckets_respect_the_cap_and_keep_pairs_whole(model_dir):
    b = policy(model_dir, "EngineMerge", seed=7)
    full = merged_source(b.model)
    buckets = plan_buckets(full.groups, CAP)
    assert len(buckets) > 3 and all(bk.nbytes <= CAP for bk in buckets)
    assert any(p.start > 0 for bk in buckets for p in bk.pieces)  # big tensors were split, still under the cap
    pairs = adapter_source(b.model)
    for bk in plan_buckets(pairs.groups, 4 * 1024):
        assert bk.nbytes <= 4 * 1024
        names = [p.name for p in bk.pieces]
        assert all(p.start == 0 and p.end == p.tensor_nbytes for p in bk.pieces)  # a pair member is never split
        for n in names:
            partner = n.replace("lora_A", "lora_B") if "lora_A" in n else n.replace("lora_B", "lora_A")
            assert partner in names
    for names in colocated_buckets(pairs.groups, 4 * 1024):
        assert all((n.replace("lora_A", "lora_B") if "lora_A" in n else n.replace("lora_B", "lora_A")) in names
                   for n in names)


@pytest.mark.parametrize("transport", ["distributed", "colocated"])
def test_the_new_version_is_tagged_only_once_every_bucket_landed(engine, model_dir, transport):
    """Between two buckets of a Merge push the engine serves half-updated weights: what it generates then
    must keep the old version's tag (a lag), never claim to be the new policy."""
    b = policy(model_dir, "Merge", seed=9)
    with engine.client() as client:
        t = transport_for(transport, client)
        sender = WeightSender(b.model, b.cfg, t)
        try:
            sender.sync(version=1)
            seen: list[str | None] = []
            real_send = t.send

            def send_then_look(*args, **kwargs):
                out = real_send(*args, **kwargs)
                seen.append(served_version(client, None))  # what a request arriving now is told
                return out

            t.send = send_then_look
            with torch.no_grad():
                for p in b.params:
                    p.add_(0.01)
            report = sender.sync(version=2)
            assert report.buckets == len(seen) > 2
            assert seen == ["1"] * (len(seen) - 1) + ["2"]
        finally:
            sender.close()
