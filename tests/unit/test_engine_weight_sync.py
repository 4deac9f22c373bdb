"""Weight sync into the reference engine, with the test process as trainer rank 0 of a real gloo
group (engine rank 1) and the engine as a separate process: full weights (both load formats, a
tensor split across buckets), kora's adapter-over-the-group upsert, EngineMerge (lora_merge into a
pristine base), the same-host tensor routes, and the admin key.

Every check compares the engine's log-probs with a plain transformers / peft forward of the
weights that were pushed (ATOL = 1e-4, fp32), and first shows they differ before the push.
"""

from __future__ import annotations

import time

import pytest
import requests
import torch

from engine_helpers import (
    ATOL,
    broadcast_bucket,
    engine_vs_reference,
    load_hf,
    make_peft_adapter,
    peft_config_dict,
    peft_tensors,
    push_weights,
    random_weights,
    start_engine,
    stop_engine,
    trainer_group,
    wait_engine_state,
)
from kora_trainer.wire.engine_client import EngineClient, EngineError, applied_checksum
from kora_trainer.wire.lora_names import split_lora_name
from kora_trainer.wire.protocol import FLAT, checksum, plan_buckets
from kora_trainer.wire.serialize import serialize_named_tensors
from tinymodel import make_tiny_model

pytestmark = pytest.mark.timeout(180)
ADMIN_KEY = "admin-secret"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    proc = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "--admin-api-key", ADMIN_KEY)
    yield proc
    stop_engine(proc)


@pytest.fixture(scope="module")
def client(engine):
    with EngineClient(engine.url, api_key=ADMIN_KEY, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def group(client):
    with trainer_group(client) as g:
        yield g


@pytest.fixture(scope="module")
def base_weights(model_dir):
    return [(n, p.detach().clone()) for n, p in load_hf(model_dir).named_parameters()]


def model_with(model_dir, named):
    model = load_hf(model_dir)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for n, t in named:
            params[n].copy_(t)
    return model


def test_admin_routes_need_the_admin_key(engine, model_dir):
    r = requests.post(engine.url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"}, timeout=30)
    assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
    assert requests.get(engine.url + "/health", timeout=30).status_code == 200
    with EngineClient(engine.url) as anonymous:  # /generate is a normal route: open without --api-key
        assert anonymous.generate([[1, 4]], {"max_new_tokens": 1})[0].output_ids
        with pytest.raises(EngineError) as err:
            anonymous.unload_lora_adapter("x")
        assert err.value.status == 401 and err.value.message == "Unauthorized"


@pytest.mark.parametrize("load_format", [FLAT, None], ids=["flattened_bucket", "per_tensor"])
def test_update_weights_from_distributed(client, group, model_dir, load_format):
    new = random_weights(load_hf(model_dir), seed=11 if load_format else 12)
    reference = model_with(model_dir, new)
    assert engine_vs_reference(client, reference) > 1e-2
    # flattened: a 3000-byte cap splits the 4096-byte embedding over buckets; per tensor: no splits
    cap = 3000 if load_format == FLAT else 1 << 30
    results = push_weights(client, group, new, cap, load_format, weight_version=f"v-{load_format}")
    assert engine_vs_reference(client, reference) < ATOL
    assert all(r["success"] and r["weight_version"] == f"v-{load_format}" for r in results)
    assert results[-1]["message"] == f"Succeeded to update parameter online. Weight version updated to v-{load_format}."
    tensors = dict(new)
    buckets = plan_buckets([[nt] for nt in new], cap)
    assert [r["checksum"] for r in results] == [applied_checksum(b.metadata(), tensors) for b in buckets]
    assert client.model_info()["weight_version"] == f"v-{load_format}"
    out = client.generate([[1, 4, 5]], {"max_new_tokens": 1})[0]
    assert out.weight_version == f"v-{load_format}"


def test_model_info_and_health_answer_while_an_update_waits_for_its_broadcast(client, group, model_dir):
    named = random_weights(load_hf(model_dir), seed=13, names=["lm_head.weight"])
    bucket = plan_buckets([named], 1 << 20)[0]
    fut = client.submit(client.update_weights_from_distributed, bucket.metadata(), load_format=FLAT)
    wait_engine_state(client, "the engine blocked in the broadcast", receiving=1)
    start = time.monotonic()
    assert client.model_info()["model_path"] and client.health(timeout=5)
    assert time.monotonic() - start < 5 and not fut.done()
    broadcast_bucket(group, bucket, dict(named), FLAT)
    assert fut.result(timeout=60)["success"]


def test_bad_metadata_is_refused_before_any_broadcast(client):
    with pytest.raises(EngineError) as err:
        client.update_weights_from_distributed({"names": ["a"], "dtypes": ["float32"], "shapes": [[2]],
                                                "byte_ranges": [[0, 4]]}, load_format=None)
    assert err.value.status == 400 and "flattened_bucket" in err.value.message
    with pytest.raises(EngineError) as err:
        client.post("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"]})
    assert err.value.body["type"] == "Bad Request" and "shapes" in err.value.message


def test_adapter_over_the_group_is_upserted_and_matches_peft(client, group, model_dir, base_weights, tmp_path):
    push_weights(client, group, base_weights, 1 << 20, FLAT)
    for seed in (21, 22):  # the second push replaces the first under the same name, no unload
        _, peft_model = make_peft_adapter(model_dir, tmp_path / f"a{seed}", seed=seed)
        named = peft_tensors(peft_model)
        tensors = dict(named)
        buckets = plan_buckets([[nt] for nt in named], 700)  # small cap: tensors split across buckets
        assert any(r[0] != 0 for b in buckets for r in b.metadata()["byte_ranges"])
        config = peft_config_dict(peft_model)
        for i, bucket in enumerate(buckets):
            fut = client.submit(client.load_lora_adapter_from_distributed, "kora-policy", config, bucket.metadata(),
                                bucket_index=i, num_buckets=len(buckets), weight_version=f"step-{seed}")
            broadcast_bucket(group, bucket, tensors, FLAT)
            out = fut.result(timeout=60)
            assert out["success"] and set(out) >= {"rid", "http_worker_ipc", "error_message", "loaded_adapters"}
        assert out["loaded_adapters"]["kora-policy"] == "__distributed__"
        assert out["weight_version"] == f"step-{seed}" and out["checksum"] == checksum(named)
        assert engine_vs_reference(client, peft_model, lora_path="kora-policy") < ATOL
        gen = client.generate([[1, 4]], {"max_new_tokens": 1}, lora_path="kora-policy")[0]
        assert gen.weight_version == f"step-{seed}"


def test_out_of_order_adapter_bucket_is_refused_after_receiving_it(client, group, model_dir, tmp_path):
    _, peft_model = make_peft_adapter(model_dir, tmp_path / "a", seed=5)
    named = peft_tensors(peft_model)
    bucket = plan_buckets([named], 1 << 20)[0]
    fut = client.submit(client.load_lora_adapter_from_distributed, "late", {"r": 4, "lora_alpha": 8},
                        bucket.metadata(), bucket_index=1, num_buckets=2)
    broadcast_bucket(group, bucket, dict(named), FLAT)  # the group stays in step even though it is refused
    with pytest.raises(EngineError) as err:
        fut.result(timeout=60)
    assert err.value.status == 400 and "expected bucket 0" in err.value.message
    assert client.health()


def lora_merge_push(client, group, named, alpha, rank, cap):
    pairs: dict[str, list] = {}
    for name, t in named:
        pairs.setdefault(split_lora_name(name)[0], []).append((name, t))
    buckets = plan_buckets(list(pairs.values()), cap)
    for bucket in buckets:  # a pair never splits
        modules = [split_lora_name(n)[0] for n in bucket.metadata()["names"]]
        assert all(modules.count(m) == 2 for m in modules)
    tensors = dict(named)
    for bucket in buckets:
        fut = client.submit(client.update_weights_lora_merge, bucket.metadata(), alpha, rank, merge_fp32=True,
                            load_format=FLAT)
        broadcast_bucket(group, bucket, tensors, FLAT)
        assert fut.result(timeout=60)["success"]
    return len(buckets)


def test_lora_merge_folds_into_a_pristine_base(client, group, model_dir, base_weights, tmp_path):
    push_weights(client, group, base_weights, 1 << 20, FLAT)
    for seed in (31, 32):  # the second merge starts again from W0: merges never accumulate
        _, peft_model = make_peft_adapter(model_dir, tmp_path / f"m{seed}", seed=seed, r=4, alpha=8.0)
        assert engine_vs_reference(client, peft_model) > 1e-2
        assert lora_merge_push(client, group, peft_tensors(peft_model), 8.0, 4, cap=5000) > 1
        assert engine_vs_reference(client, peft_model) < ATOL  # the base (no lora_path) serves W0 + s·BA


def test_full_update_resets_the_pristine_base(client, group, model_dir, tmp_path):
    new = random_weights(load_hf(model_dir), seed=41)
    push_weights(client, group, new, 1 << 20, FLAT)
    _, peft_model = make_peft_adapter(model_dir, tmp_path / "m", seed=42)
    lora_merge_push(client, group, peft_tensors(peft_model), 8.0, 4, cap=1 << 20)
    reference = model_with(model_dir, new)
    with torch.no_grad():  # W = new + s·BA
        params = dict(reference.named_parameters())
        for module, ab in _pairs(peft_tensors(peft_model)).items():
            params[f"{module}.weight"] += 2.0 * ab["B"] @ ab["A"]
    assert engine_vs_reference(client, reference) < ATOL


def _pairs(named):
    out: dict[str, dict] = {}
    for name, t in named:
        module, which = split_lora_name(name)
        out.setdefault(module, {})[which] = t
    return out


def test_tensor_routes_across_processes(client, model_dir, base_weights, tmp_path):
    new = random_weights(load_hf(model_dir), seed=51)
    out = client.update_weights_from_tensor(serialize_named_tensors(new), weight_version="t1")
    assert out["success"] and out["message"] == "Success Weight version updated to t1."
    assert out["checksum"] == checksum(new)
    assert engine_vs_reference(client, model_with(model_dir, new)) < ATOL
    client.update_weights_from_tensor(serialize_named_tensors(base_weights))
    _, peft_model = make_peft_adapter(model_dir, tmp_path / "t", seed=52)
    config = peft_config_dict(peft_model)
    serialized = serialize_named_tensors(peft_tensors(peft_model))
    out = client.load_lora_adapter_from_tensors("from-tensors", config, serialized)
    assert out["success"] and out["loaded_adapters"]["from-tensors"] == "__tensor__"
    assert engine_vs_reference(client, peft_model, lora_path="from-tensors") < ATOL
    with pytest.raises(EngineError) as err:
        client.load_lora_adapter_from_tensors("from-tensors", config, serialize_named_tensors(peft_tensors(peft_model)))
    assert err.value.message == "Failed to load LoRA adapter from-tensors because it is already loaded"


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_weight_update_runs_while_generation_is_paused(client, base_weights, mode):
    fut = client.submit(client.generate, [[1, 4, 5, 13]] * 16, {"max_new_tokens": 240, "ignore_eos": True})
    deadline = time.monotonic() + 10
    while True:  # bounded wait until the request is in flight (flush_cache refuses while busy)
        try:
            client.flush_cache()
        except EngineError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.005)
    client.pause_generation(mode)
    # the paused generation released the model: the update does not wait for it
    update = client.submit(client.update_weights_from_tensor, serialize_named_tensors(base_weights),
                           weight_version=f"paused-{mode}")
    assert update.result(timeout=30)["success"] and not fut.done()
    client.continue_generation()
    outs = fut.result(timeout=60)
    assert all(o.finish_reason == {"type": "length", "length": 240} for o in outs)
    assert outs[0].weight_version == f"paused-{mode}"
    assert outs[0].meta_info["num_retractions"] == (1 if mode == "retract" else 0)
