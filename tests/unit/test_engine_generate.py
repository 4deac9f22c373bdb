"""The reference engine as a real process on 127.0.0.1: generation, log-probs, adapters, error bodies.

References are plain transformers / peft computations in the test process. Tolerance: log-probs
agree to ATOL = 1e-4 (fp32 on both sides; only the summation order differs: padding, batching,
KV cache).
"""

from __future__ import annotations

import json
import time

import pytest
import requests
import torch

from engine_helpers import (
    ATOL,
    PROMPTS,
    engine_vs_reference,
    load_hf,
    make_peft_adapter,
    reference_logprobs,
    start_engine,
    stop_engine,
    wait_engine_state,
)
from kora_engine.lm.contract import SAMPLING_FIELDS
from kora_trainer.wire.engine_client import EngineClient, EngineError
from tinymodel import make_tiny_model

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def base(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    proc = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "--max-loras-per-batch", "2")
    yield proc
    stop_engine(proc)


@pytest.fixture(scope="module")
def client(engine):
    with EngineClient(engine.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def adapters(model_dir, client, tmp_path_factory):
    """Two PEFT adapters made by peft, loaded under 'a' and 'b'."""
    root = tmp_path_factory.mktemp("adapters")
    path_a, peft_a = make_peft_adapter(model_dir, root / "a", seed=1)
    path_b, peft_b = make_peft_adapter(model_dir, root / "b", seed=2, r=2, alpha=4.0, targets=("q_proj", "v_proj"))
    client.load_lora_adapter("a", str(path_a))
    client.load_lora_adapter("b", str(path_b))
    return {"a": (path_a, peft_a), "b": (path_b, peft_b)}


def test_health_and_model_info(client, engine, model_dir):
    assert client.health()
    info = client.model_info()
    assert info["model_path"] == str(model_dir)
    assert info["is_generation"] is True and info["weight_version"] == "default"
    assert info["architectures"] == ["Qwen3ForCausalLM"] and info["kora_engine"] == "hf"
    assert client.request("GET", "/get_model_info") == info
    assert requests.get(engine.url + "/health_generate", timeout=30).status_code == 200


def test_greedy_matches_transformers_generate_and_logprobs_match_a_plain_forward(client, base, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    outs = client.generate(PROMPTS, {"max_new_tokens": 6, "temperature": 0.0})
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            hf = base.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
        assert out.output_ids == hf
        ref = reference_logprobs(base, prompt, out.output_ids)
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, ref, strict=True)) < ATOL
        assert out.text == tok.decode(out.output_ids, skip_special_tokens=True)
        assert out.finish_reason in ({"type": "length", "length": 6}, {"type": "stop", "matched": 2})
        meta = out.meta_info
        assert meta["completion_tokens"] == len(out.output_ids) == meta["output_token_logprobs_length"]


def test_logprobs_are_raw_even_when_sampling_with_temperature(client, base):
    outs = client.generate(PROMPTS, {"max_new_tokens": 5, "temperature": 0.7, "top_k": 5, "sampling_seed": 3,
                                     "ignore_eos": True})
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = reference_logprobs(base, prompt, out.output_ids)
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, ref, strict=True)) < ATOL


def test_input_and_top_logprobs(client, base):
    prompt = PROMPTS[0]
    raw = client.post("/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                                    "top_logprobs_num": 3, "sampling_params": {"max_new_tokens": 2,
                                                                               "temperature": 0}})
    meta = raw["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None
    ref = reference_logprobs(base, prompt[:1], prompt[1:])
    assert max(abs(e[0] - r) for e, r in zip(entries[1:], ref, strict=True)) < ATOL
    top = meta["output_top_logprobs"][0]
    assert len(top) == 3 and top[0][1] == raw["output_ids"][0] and top[0][0] >= top[1][0] >= top[2][0]


def test_sampling_seed_reproduces_a_sample_whatever_the_batch(client):
    params = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    alone = client.generate([PROMPTS[1]], params)[0].output_ids
    in_batch = client.generate(PROMPTS, params)[1].output_ids
    assert alone == in_batch == client.generate([PROMPTS[1]], params)[0].output_ids
    seeds = {tuple(client.generate([PROMPTS[1]], {**params, "sampling_seed": s})[0].output_ids) for s in range(4)}
    assert len(seeds) > 1  # the seed, not a fixed path, decides the sample
    unseeded = client.generate([PROMPTS[1]], {"max_new_tokens": 6, "n": 8, "ignore_eos": True})
    assert len({tuple(o.output_ids) for o in unseeded}) > 1


def test_response_shapes_single_batch_and_n(client):
    single = client.post("/generate", {"text": "12+34=", "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(single, dict) and set(single) >= {"text", "output_ids", "meta_info"}
    assert single["meta_info"]["prompt_tokens"] == 7 and "output_token_logprobs" not in single["meta_info"]
    many = client.post("/generate", {"input_ids": PROMPTS[:2], "rid": "r",
                                     "sampling_params": {"max_new_tokens": 2, "n": 3}})
    assert isinstance(many, list) and len(many) == 6
    assert [m["meta_info"]["prompt_tokens"] for m in many] == [len(PROMPTS[0])] * 3 + [len(PROMPTS[1])] * 3
    assert [m["meta_info"]["id"] for m in many[:3]] == ["r_0_0", "r_0_1", "r_0_2"]
    one_n = client.post("/generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 1, "n": 2}})
    assert isinstance(one_n, list) and len(one_n) == 2


def test_stop_token_and_stop_string(client, model_dir):
    greedy = client.generate([PROMPTS[0]], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})[0]
    first = greedy.output_ids[0]
    out = client.generate([PROMPTS[0]], {"max_new_tokens": 4, "temperature": 0, "stop_token_ids": [first]})[0]
    assert out.output_ids == [first] and out.finish_reason == {"type": "stop", "matched": first}
    stop = greedy.text[1]
    out = client.generate([PROMPTS[0]], {"max_new_tokens": 4, "temperature": 0, "stop": stop, "ignore_eos": True})[0]
    assert out.finish_reason == {"type": "stop", "matched": stop} and out.text == greedy.text[:1]
    out = client.generate([PROMPTS[0]], {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})[0]
    assert out.finish_reason == {"type": "length", "length": 3} and len(out.output_ids) == 3


def test_peft_adapter_gives_the_peft_models_logprobs(client, adapters, base):
    _, peft_a = adapters["a"]
    assert engine_vs_reference(client, peft_a, lora_path="a") < ATOL
    assert engine_vs_reference(client, base, lora_path="a") > 1e-2  # the adapter really changes the model
    assert engine_vs_reference(client, base, lora_path=None) < ATOL


def test_one_batch_mixes_base_and_two_adapters(client, adapters, base):
    # three distinct adapters (base counts) with --max-loras-per-batch 2: split into two forward batches
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    loras = [None, "a", "b", "a"]
    refs = {None: base, "a": adapters["a"][1], "b": adapters["b"][1]}
    outs = client.generate(prompts, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}, lora_path=loras)
    for prompt, lora, out in zip(prompts, loras, outs, strict=True):
        ref = reference_logprobs(refs[lora], prompt, out.output_ids)
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, ref, strict=True)) < ATOL


def test_loading_a_loaded_name_fails_like_sglang(client, adapters):
    path_a, _ = adapters["a"]
    with pytest.raises(EngineError) as err:
        client.load_lora_adapter("a", str(path_a))
    assert err.value.status == 400
    assert err.value.body == {"rid": None, "http_worker_ipc": None, "success": False,
                              "error_message": "Failed to load LoRA adapter a because it is already loaded",
                              "loaded_adapters": {"a": str(path_a), "b": str(adapters["b"][0])}}


def test_unload_unknown_and_implicit_reload(client, adapters):
    _, peft_a = adapters["a"]
    with pytest.raises(EngineError) as err:
        client.generate([PROMPTS[0]], {"max_new_tokens": 1}, lora_path="never")
    assert err.value.status == 400
    assert err.value.body == {"error": {"message": "Got LoRA adapter that has never been loaded: never\n"
                                                   "All loaded adapters: dict_keys(['a', 'b'])."}}
    with pytest.raises(EngineError) as err:
        client.unload_lora_adapter("never")
    assert err.value.body["error_message"] == \
        "LoRA with name never does not exist. Loaded LoRAs: odict_keys(['a', 'b'])"
    out = client.unload_lora_adapter("a")
    assert out["success"] is True and out["error_message"] == "" and "a" not in out["loaded_adapters"]
    assert engine_vs_reference(client, peft_a, lora_path="a") < ATOL  # SGLang reloads an unloaded name
    assert client.model_info()  # still serving


def test_error_bodies_match_sglang(client, engine):
    def post(route, body):
        r = requests.post(engine.url + route, json=body, timeout=30)
        return r.status_code, r.json()

    status, body = post("/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 4}})
    assert status == 400 and body == {"error": "unknown field `max_tokens`, expected one of "
                                      + ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)}
    status, body = post("/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}})
    assert (status, body) == (400, {"error": 'invalid type: string "hot", expected f64'})
    status, body = post("/generate", {"sampling_params": {}})
    assert (status, body) == (400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}})
    status, body = post("/generate", {"input_ids": []})
    assert (status, body) == (400, {"error": {"message": "input_ids cannot be empty."}})
    status, body = post("/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and body["object"] == "error" and body["type"] == "Bad Request"
    assert body["param"] is None and body["code"] == 400 and "lora_path" in body["message"]
    with pytest.raises(EngineError) as err:
        EngineClient(engine.url).generate([[1]], {"top_p": 0.0})
    assert err.value.status == 400 and "top_p" in err.value.message


def test_stream_returns_one_cumulative_chunk_per_item_then_done(engine):
    body = {"input_ids": [PROMPTS[0], PROMPTS[1]], "stream": True,
            "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    r = requests.post(engine.url + "/generate", json=body, timeout=30)
    lines = [ln for ln in r.text.split("\n\n") if ln]
    assert r.headers["Content-Type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert [c["index"] for c in chunks] == [0, 1] and all(len(c["output_ids"]) == 2 for c in chunks)


def test_pause_holds_new_requests_until_continue(client):
    assert client.pause_generation("abort") == {"message": "Generation paused successfully.", "status": "ok"}
    fut = client.submit(client.generate, [PROMPTS[0]], {"max_new_tokens": 1})
    wait_engine_state(client, "the request held by the pause", held_requests=1)
    assert not fut.done()
    assert client.flush_cache().startswith("Cache flushed.")  # nothing in flight: the held request waits
    assert client.continue_generation() == {"message": "Generation continued successfully.", "status": "ok"}
    assert len(fut.result(timeout=30)[0].output_ids) == 1


def wait_in_flight(client: EngineClient, timeout_s: float = 10.0) -> None:
    """Bounded wait until the engine has a request in flight (flush_cache refuses while busy)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            client.flush_cache()
        except EngineError as e:
            assert e.status == 400
            return
        time.sleep(0.005)
    raise AssertionError("the request never showed up as in flight")


def test_pause_abort_ends_requests_in_flight(client):
    fut = client.submit(client.generate, PROMPTS * 6, {"max_new_tokens": 240, "ignore_eos": True})
    wait_in_flight(client)
    client.pause_generation("abort")  # returns once nothing is in flight
    outs = fut.result(timeout=60)
    client.continue_generation()
    assert all(o.finish_reason == {"type": "abort", "message": "Abort all requests.", "status_code": None,
                                   "err_type": None} for o in outs)
    assert len(outs[0].output_ids) < 240 and len(outs[0].output_ids) == len(outs[0].output_logprobs)


def test_concurrent_calls_are_merged_and_each_gets_its_own_results(client, adapters):
    calls = [([PROMPTS[i % 3]], {"max_new_tokens": 4, "sampling_seed": 100 + i, "n": 2, "ignore_eos": True},
              [None, "a", "b"][i % 3]) for i in range(9)]
    alone = [[o.output_ids for o in client.generate(p, sp, lora_path=lp)] for p, sp, lp in calls]
    futs = [client.submit(client.generate, p, sp, lora_path=lp) for p, sp, lp in calls]
    together = [[o.output_ids for o in f.result(timeout=60)] for f in futs]
    assert together == alone  # seeded samples do not depend on what else shares the batch


def test_update_weight_version_relabels_what_generate_reports(client, engine):
    before = client.generate([[1, 2]], {"max_new_tokens": 1})[0].weight_version
    out = client.update_weight_version("v-test")
    assert out == {"success": True, "message": "Weight version updated to v-test", "new_version": "v-test"}
    assert client.generate([[1, 2]], {"max_new_tokens": 1})[0].weight_version == "v-test"
    r = requests.post(engine.url + "/update_weight_version", json={"abort_all_requests": True}, timeout=30)
    assert r.status_code == 400 and "new_version" in r.json()["message"]  # the field is required, as in SGLang
    client.update_weight_version(before or "default")
