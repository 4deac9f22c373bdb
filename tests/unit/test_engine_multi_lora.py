"""Several adapters in one reference engine, SGLang-style (issue 16 item 3): each request names its adapter
(`lora_path`) and keeps the adapter object it was admitted with; publishing a new version of one adapter
(kora's `/load_lora_adapter_from_distributed` upsert, the test process as trainer rank 0 of a gloo group)
never holds up another adapter's generation; `/abort_request` by rid, by rid prefix (`<adapter>::`,
sglang-miles #30912) and abort_all; a retired (unloaded) name can be loaded again.

Waits are bounded waits on the engine's GET /kora/state (in-flight counts per adapter / version / rid
prefix), never sleeps. Log-probs are compared with plain peft forwards (ATOL, fp32).
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from engine_helpers import (
    ATOL,
    PROMPTS,
    broadcast_bucket,
    engine_vs_reference,
    make_peft_adapter,
    peft_config_dict,
    peft_tensors,
    publish_adapter,
    reference_logprobs,
    retire_and_reload,
    serialize_adapter,
    served_engine,
    trainer_group,
)
from kora_trainer.wire.engine_client import EngineClient
from kora_trainer.wire.protocol import FLAT, plan_buckets
from localcluster import wait_for
from tinymodel import make_tiny_model

pytestmark = pytest.mark.timeout(240)
ADMIN_KEY = "multi-lora-admin"
LONG = {"max_new_tokens": 230, "temperature": 0.0, "ignore_eos": True}  # ~all of the tiny model's 256 positions
SHORT = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
BOUND_S = 30.0
CHURN_ROUNDS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    with served_engine(model_dir, tmp_path_factory.mktemp("logs"), "--admin-api-key", ADMIN_KEY,
                       key=ADMIN_KEY) as pair:
        yield pair


@pytest.fixture(scope="module")
def engine(served):
    return served[0]


@pytest.fixture(scope="module")
def client(served):
    return served[1]


@pytest.fixture(scope="module")
def peft(model_dir, tmp_path_factory):
    """Three distinct PEFT adapters: {seed: (dir, peft model)}."""
    root = tmp_path_factory.mktemp("adapters")
    return {seed: make_peft_adapter(model_dir, root / f"s{seed}", seed=seed) for seed in (31, 32, 33)}


@pytest.fixture(scope="module")
def group(client):
    with trainer_group(client) as g:
        yield g


def wait_state(client: EngineClient, what: str, pred, timeout_s: float = BOUND_S) -> dict:
    seen: dict = {}

    def reached() -> bool:
        seen.update(client.kora_state())
        return bool(pred(seen))

    wait_for(reached, timeout=timeout_s, interval=0.02, what=what)
    return seen


def worst_gap(reference, prompt, out) -> float:
    ref = reference_logprobs(reference, prompt, out.output_ids)
    return max(abs(a - b) for a, b in zip(out.output_logprobs, ref, strict=True))


def test_two_adapters_each_request_gets_its_own(client, peft):
    (dir_a, model_a), (dir_b, model_b) = peft[31], peft[32]
    client.load_lora_adapter("two-a", str(dir_a))
    client.load_lora_adapter("two-b", str(dir_b))
    try:
        assert engine_vs_reference(client, model_a, lora_path="two-a") < ATOL
        assert engine_vs_reference(client, model_b, lora_path="two-b") < ATOL
        # one batch mixing both adapters and the base: each row gets its own adapter
        outs = client.generate([PROMPTS[0]] * 3, SHORT, lora_path=["two-a", "two-b", None])
        assert worst_gap(model_a, PROMPTS[0], outs[0]) < ATOL and worst_gap(model_b, PROMPTS[0], outs[1]) < ATOL
        assert worst_gap(model_a, PROMPTS[0], outs[1]) > 10 * ATOL  # the adapters do differ
        assert [o.meta_info["id"] for o in client.generate([PROMPTS[0]] * 2, SHORT, rid=["r::1", "r::2"])] \
            == ["r::1", "r::2"]
    finally:
        client.unload_lora_adapter("two-a")
        client.unload_lora_adapter("two-b")


def test_a_request_keeps_the_version_it_was_admitted_with(client, group, peft):
    (_, v1), (_, v2) = peft[31], peft[32]
    prompt = PROMPTS[1]
    publish_adapter(client, group, "pub", v1, "v1")
    rid = f"pub::{uuid.uuid4().hex}"
    fut = client.submit(client.generate, [prompt], LONG, lora_path="pub", rid=rid)
    wait_state(client, "the long request admitted on v1",
               lambda s: s["in_flight_by_adapter_version"].get("pub", {}).get("v1") == 1)
    out = publish_adapter(client, group, "pub", v2, "v2")
    assert out["success"] and out["weight_version"] == "v2"
    state = client.kora_state()
    # the new version is what a new request gets, while the one admitted before still runs on v1
    assert state["adapters"]["pub"]["version"] == "v2"
    assert state["in_flight_by_adapter_version"]["pub"] == {"v1": 1}, "the long request ended before the publish"
    old = fut.result(timeout=120)[0]
    assert old.weight_version == "v1" and old.finish_reason["type"] == "length"
    assert worst_gap(v1, prompt, old) < ATOL  # every token of it came from v1
    new = client.generate([prompt], SHORT, lora_path="pub")[0]
    assert new.weight_version == "v2" and worst_gap(v2, prompt, new) < ATOL
    client.unload_lora_adapter("pub")


def _churn_while_b_generates(client: EngineClient, churn, rounds: int) -> list:
    """`churn()` `rounds` times back to back (A's trainer) while two B senders generate SHORT requests until the
    churn is done; B's outputs, and how many B requests were answered while A was busy."""
    done = threading.Event()
    outs: list = []

    def b_sender() -> None:
        while not done.is_set():
            prompt = PROMPTS[len(outs) % 3]
            outs.append((prompt, client.generate([prompt], SHORT, lora_path="steady")[0]))

    with ThreadPoolExecutor(2) as pool:
        senders = [pool.submit(b_sender) for _ in range(2)]
        try:
            for _ in range(rounds):
                churn()
        finally:
            done.set()
            for s in senders:
                s.result(timeout=BOUND_S)
    return outs


def test_publishing_one_adapter_never_holds_up_another(client, group, peft):
    (_, a1), (_, a2), (dir_b, model_b) = peft[31], peft[32], peft[33]
    client.load_lora_adapter("steady", str(dir_b))
    publish_adapter(client, group, "hot", a1, "h0")
    try:
        # 1. never blocked: A's publication is under way (the engine waits in its broadcast) while B generates
        named = peft_tensors(a2)
        bucket = plan_buckets([named], 1 << 22)[0]
        fut = client.submit(client.load_lora_adapter_from_distributed, "hot", peft_config_dict(a2),
                            bucket.metadata(), weight_version="h1")
        wait_state(client, "A's publication receiving", lambda s: s["receiving"] == 1)
        outs = client.generate(PROMPTS, SHORT, lora_path="steady")
        assert client.kora_state()["receiving"] == 1 and not fut.done()  # B finished inside A's publication
        assert max(worst_gap(model_b, p, o) for p, o in zip(PROMPTS, outs, strict=True)) < ATOL
        broadcast_bucket(group, bucket, dict(named), FLAT)
        assert fut.result(timeout=60)["weight_version"] == "h1"

        # 2. A publishing back to back while B generates: every B answer is B's own adapter, whole (how much of
        # B's throughput A's publications cost is a measurement: bench/multi_lora_isolation.py)
        versions = iter(range(2, 100))

        def publish_next() -> None:
            v = next(versions)
            publish_adapter(client, group, "hot", (a1, a2)[v % 2], f"h{v}")

        outs = _churn_while_b_generates(client, publish_next, CHURN_ROUNDS)
        assert_all_b(outs, model_b)
        state = client.kora_state()
        assert state["adapters"]["hot"]["version"] == f"h{CHURN_ROUNDS + 1}" and state["in_flight"] == 0
    finally:
        client.unload_lora_adapter("steady")
        client.unload_lora_adapter("hot")


def test_abort_by_prefix_ends_one_adapters_requests_only(client, engine, peft):
    (dir_a, _), (dir_b, model_b) = peft[31], peft[33]
    client.load_lora_adapter("ab-a", str(dir_a))
    client.load_lora_adapter("ab-b", str(dir_b))
    four = PROMPTS + PROMPTS[:1]
    try:
        # 3 A calls and 2 B calls of 4 prompts each, released together: 20 rows x 230 tokens keep the engine
        # busy far longer than the abort takes to arrive
        client.pause_generation("in_place")
        try:
            a_futs = [client.submit(client.generate, four, LONG, lora_path="ab-a",
                                    rid=[f"ab-a::{uuid.uuid4().hex}" for _ in four]) for _ in range(3)]
            b_futs = [client.submit(client.generate, four, LONG, lora_path="ab-b",
                                    rid=[f"ab-b::{uuid.uuid4().hex}" for _ in four]) for _ in range(2)]
            wait_state(client, "5 calls held", lambda s: s["held_requests"] == 5)
        finally:
            client.continue_generation()
        wait_state(client, "12 A and 8 B requests in flight",
                   lambda s: s["in_flight_by_rid_prefix"] == {"ab-a::": 12, "ab-b::": 8} and s["held_requests"] == 0)
        # the admin route: no key, no abort
        r = requests.post(engine.url + "/abort_request", json={"rid": "ab-a::", "prefix": True}, timeout=30)
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
        client.abort_request("ab-a::", prefix=True)
        wait_state(client, "0 A requests in flight", lambda s: "ab-a::" not in s["in_flight_by_rid_prefix"])
        for fut in a_futs:
            for out in fut.result(timeout=BOUND_S):
                assert out.finish_reason == {"type": "abort", "message": "Aborted", "status_code": None,
                                             "err_type": None}
                assert len(out.output_ids) < LONG["max_new_tokens"]
        for fut in b_futs:  # B ran on, to its full length, on its own adapter
            for prompt, out in zip(four, fut.result(timeout=120), strict=True):
                assert out.finish_reason["type"] == "length" and len(out.output_ids) == LONG["max_new_tokens"]
                assert worst_gap(model_b, prompt, out) < ATOL
    finally:
        client.unload_lora_adapter("ab-a")
        client.unload_lora_adapter("ab-b")


def test_abort_one_rid_and_abort_all(client):
    """Deterministic: the requests are held by an in-place pause when the abort comes, and end with
    it once generation continues; a prefix without `prefix: true` matches no rid exactly, so aborts nothing."""
    client.pause_generation("in_place")
    try:
        futs = {rid: client.submit(client.generate, [PROMPTS[0]], SHORT, rid=[rid]) for rid in ("x::1", "x::2", "y")}
        wait_state(client, "3 requests held", lambda s: s["held_requests"] == 3 and s["in_flight"] == 3)
        client.abort_request("x::")  # no flag: no request has this exact rid
        client.abort_request("x::1")
    finally:
        client.continue_generation()
    aborted = futs["x::1"].result(timeout=BOUND_S)[0]
    assert aborted.meta_info["id"] == "x::1" and aborted.finish_reason["type"] == "abort"
    assert [futs[r].result(timeout=BOUND_S)[0].finish_reason["type"] for r in ("x::2", "y")] == ["length", "length"]
    client.pause_generation("in_place")
    try:
        futs = {rid: client.submit(client.generate, [PROMPTS[0]], SHORT, rid=[rid]) for rid in ("z::1", "w")}
        wait_state(client, "2 requests held", lambda s: s["held_requests"] == 2)
        client.abort_all()
    finally:
        client.continue_generation()
    for fut in futs.values():
        out = fut.result(timeout=BOUND_S)[0]
        assert out.finish_reason["type"] == "abort" and out.output_ids == []
    assert client.generate([PROMPTS[0]], SHORT)[0].finish_reason["type"] == "length"  # nothing sticks


def test_a_retired_name_is_loaded_again(client, peft):
    (dir_a, model_a), (_, model_b), (dir_c, model_c) = peft[31], peft[32], peft[33]
    client.load_lora_adapter("slot", str(dir_a))
    client.load_lora_adapter("other", str(dir_c))
    try:
        assert engine_vs_reference(client, model_a, lora_path="slot") < ATOL
        fut = client.submit(client.generate, [PROMPTS[0]], LONG, lora_path="slot", rid=f"slot::{uuid.uuid4().hex}")
        wait_state(client, "a slot request in flight", lambda s: s["in_flight_by_rid_prefix"].get("slot::") == 1)
        client.abort_request("slot::", prefix=True)  # retire: abort its requests, wait for 0, unload
        wait_state(client, "0 slot requests", lambda s: "slot::" not in s["in_flight_by_rid_prefix"])
        assert fut.result(timeout=BOUND_S)[0].finish_reason["type"] == "abort"
        client.unload_lora_adapter("slot")
        assert "slot" not in client.kora_state()["adapters"]
        assert engine_vs_reference(client, model_c, lora_path="other") < ATOL  # the others keep serving
        out = client.load_lora_adapter_from_tensors(
            "slot", peft_config_dict(model_b), serialize_adapter(model_b))  # the name, reused by another adapter
        assert out["loaded_adapters"]["slot"] == "__tensor__"
        assert engine_vs_reference(client, model_b, lora_path="slot") < ATOL
    finally:
        client.unload_lora_adapter("slot")
        client.unload_lora_adapter("other")


def assert_all_b(outs: list, model_b) -> None:
    assert len(outs) >= 2 and all(o.finish_reason["type"] == "length" for _, o in outs)
    assert max(worst_gap(model_b, p, o) for p, o in outs) < ATOL


def test_retiring_one_adapter_never_holds_up_another(client, peft):
    """A's slot retired and reloaded while B's request is held in the engine (so nothing of A's retirement can
    wait for B's requests to drain, nor end them), then again and again while B generates: B's answers are whole
    and B's own. (B's throughput meanwhile is a measurement: bench/multi_lora_isolation.py.)"""
    (_, a1), (_, a2), (dir_b, model_b) = peft[31], peft[32], peft[33]
    client.load_lora_adapter("steady", str(dir_b))
    client.load_lora_adapter_from_tensors("cold", peft_config_dict(a1), serialize_adapter(a1))
    try:
        client.pause_generation("in_place")
        try:
            fut = client.submit(client.generate, [PROMPTS[2]], LONG, lora_path="steady", rid="steady::held")
            wait_state(client, "B's request held", lambda s: s["held_requests"] == 1)
            retire_and_reload(client, "cold", a2)
            assert client.kora_state()["in_flight_by_rid_prefix"] == {"steady::": 1}  # B's request untouched
        finally:
            client.continue_generation()
        assert_all_b([(PROMPTS[2], fut.result(timeout=120)[0])] * 2, model_b)
        assert engine_vs_reference(client, a2, lora_path="cold") < ATOL  # the new adapter in A's slot

        models = iter([a1, a2] * CHURN_ROUNDS)
        assert_all_b(_churn_while_b_generates(client, lambda: retire_and_reload(client, "cold", next(models)),
                                              CHURN_ROUNDS), model_b)
        assert client.kora_state()["in_flight"] == 0
    finally:
        client.unload_lora_adapter("steady")
        client.unload_lora_adapter("cold")
