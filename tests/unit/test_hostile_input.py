"""Hostile input (issue 18, item 2): every route of the reference engine and of the trainer's control plane
answers a 4xx with a message, never a 5xx, a reset or a hang, to malformed JSON, wrong types, bytes that are
not UTF-8, ids outside the vocabulary, requests past the context, bodies over the stated limit, lying
framing and methods nobody serves; and both serve normally afterwards.

Both servers are the real ones on 127.0.0.1: the engine as its own process (`python -m
kora_engine.lm` on the tiny model, vocab 16, context 256) started with a stated body limit of
1 MiB (`--max-body-bytes`, default 64 MiB) and a body timeout of 1 s (`--body-timeout-s`, default 60 s); the
control plane with the real AdapterRegistry behind /adapter_runs (its limit: 1 MiB) and a read timeout of 1 s.
The engine's routes come from its own route table, so a route added later is in the barrage too. Every request
is raw bytes on a fresh socket (hostilekit.py); every wait is bounded (10 s a request).

Set KORA_HOSTILE_RECORD=FILE to write the figures (requests, counts by status) there as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine_helpers import PROMPTS, start_engine, stop_engine
from hostilekit import (
    Hostile,
    Outcome,
    barrage,
    body_cases,
    framing_cases,
    json_cases,
    method_cases,
    request,
    tally,
    typed_cases,
)
from kora_engine.lm import request_bodies as rq
from kora_trainer.adapter_runs.api import AdapterRunsAPI
from kora_trainer.control_plane import MAX_BODY, ControlPlane, Progress
from kora_trainer.wire.engine_client import EngineClient
from specs import multi_adapter_registry
from tinymodel import make_tiny_model

pytestmark = pytest.mark.timeout(300)

ENGINE_LIMIT = 1 << 20
TIMEOUT_S = 10.0
VOCAB, CONTEXT = 16, 256  # the tiny model's
TOKEN = "s3cret"
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE")

# the pydantic body of each engine route (request_bodies.py); the fast-sync routes read a plain dict
BODY_MODELS: dict[str, type[rq.ReqInput]] = {
    "/init_weights_update_group": rq.InitWeightsUpdateGroupReqInput,
    "/destroy_weights_update_group": rq.DestroyWeightsUpdateGroupReqInput,
    "/update_weights_from_distributed": rq.UpdateWeightsFromDistributedReqInput,
    "/update_weights_from_tensor": rq.UpdateWeightsFromTensorReqInput,
    "/load_lora_adapter": rq.LoadLoRAAdapterReqInput,
    "/load_lora_adapter_from_tensors": rq.LoadLoRAAdapterFromTensorsReqInput,
    "/load_lora_adapter_from_distributed": rq.LoadLoRAAdapterFromDistributedReqInput,
    "/unload_lora_adapter": rq.UnloadLoRAAdapterReqInput,
    "/update_weight_version": rq.UpdateWeightVersionReqInput,
    "/pause_generation": rq.PauseGenerationReqInput,
    "/abort_request": rq.AbortReq,
    "/continue_generation": rq.ContinueGenerationReqInput,
}
FAST_SYNC_FIELDS = {
    "/kora/fast_sync/plan": {"group_name": str, "mode": str, "metadata": list, "slots": int, "lora_name": str,
                             "config_dict": dict},
    "/kora/fast_sync/push": {"group_name": str, "weight_version": str, "verify": bool},
}
ONE = {"input_ids": [1]}
GENERATE_BAD: list[dict] = [
    # ids outside the vocabulary, or outside i32
    {"input_ids": [VOCAB]}, {"input_ids": [99]}, {"input_ids": [2**31 - 1]}, {"input_ids": [-1]},
    {"input_ids": [-(2**31)]}, {"input_ids": [2**31]}, {"input_ids": [2**40]}, {"input_ids": [-(2**40)]},
    {"input_ids": [[1, 2], [3, VOCAB]]}, {"input_ids": [[1], [-3]]}, {"input_ids": [1.5]}, {"input_ids": [True]},
    {"input_ids": "12"}, {"input_ids": [[1], 2]}, {"input_ids": []}, {"input_ids": [[]]}, {"input_ids": [[1], []]},
    # past the context
    {"input_ids": [1] * CONTEXT}, {"input_ids": [1] * (CONTEXT + 100)},
    {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": CONTEXT - 5}},
    {**ONE, "sampling_params": {"max_new_tokens": 10**12}}, {**ONE, "sampling_params": {"max_new_tokens": 2**63 - 1}},
    {**ONE, "sampling_params": {"max_new_tokens": 2**64}}, {**ONE, "sampling_params": {"max_new_tokens": -1}},
    {**ONE, "sampling_params": {"max_new_tokens": "10"}}, {**ONE, "sampling_params": {"max_new_tokens": 1.0}},
    # too many sequences in one call
    {**ONE, "sampling_params": {"n": 10**9}}, {"input_ids": [[1]] * 70_000}, {"text": ["1"] * 70_000},
    {"input_ids": [[1]] * 2_000, "sampling_params": {"n": 40}}, {**ONE, "sampling_params": {"n": 0}},
    {**ONE, "sampling_params": {"n": -1}},
    # text
    {"text": ""}, {"text": []}, {"text": "\ud800"}, {"text": 5}, {"text": ["1", 2]}, {"sampling_params": {}},
    {**ONE, "input_embeds": [[0.1]]},
    # sampling parameters
    {**ONE, "sampling_params": {"max_tokens": 3}}, {**ONE, "sampling_params": {"temperature": "hot"}},
    {**ONE, "sampling_params": {"temperature": -1}}, {**ONE, "sampling_params": {"top_p": 0}},
    {**ONE, "sampling_params": {"top_p": 1.5}}, {**ONE, "sampling_params": {"top_k": 0}},
    {**ONE, "sampling_params": {"min_p": 2}}, {**ONE, "sampling_params": {"repetition_penalty": 0}},
    {**ONE, "sampling_params": {"repetition_penalty": 3}}, {**ONE, "sampling_params": {"frequency_penalty": 5}},
    {**ONE, "sampling_params": {"presence_penalty": -5}},
    {**ONE, "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
    {**ONE, "sampling_params": {"min_new_tokens": -1}}, {**ONE, "sampling_params": {"logit_bias": {"99": 1.0}}},
    {**ONE, "sampling_params": {"logit_bias": {"-1": 1.0}}}, {**ONE, "sampling_params": {"logit_bias": {"abc": 1}}},
    {**ONE, "sampling_params": {"logit_bias": {"1": "x"}}}, {**ONE, "sampling_params": {"logit_bias": [1]}},
    {**ONE, "sampling_params": {"stop_regex": "("}}, {**ONE, "sampling_params": {"stop_regex": ["ok", "[z-a]"]}},
    {**ONE, "sampling_params": {"stop": 5}}, {**ONE, "sampling_params": {"stop_token_ids": ["x"]}},
    {**ONE, "sampling_params": {"json_schema": "{}"}}, {**ONE, "sampling_params": {"regex": "a+"}},
    {**ONE, "sampling_params": "x"}, {**ONE, "sampling_params": [5]}, {**ONE, "sampling_params": [{}, {}]},
    {"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]},
    # the other fields
    {**ONE, "lora_path": "never-loaded"}, {**ONE, "lora_path": 5}, {**ONE, "lora_path": [5]}, {**ONE, "rid": 5},
    {**ONE, "rid": [1]}, {**ONE, "return_logprob": "yes"}, {**ONE, "logprob_start_len": "x"},
    {**ONE, "top_logprobs_num": 2**63}, {**ONE, "stream": "yes"},
]
PROTOCOL_GARBAGE = [  # the request line and headers themselves (aiohttp's parser answers in text/plain)
    b"\x00\x01\x02garbage\r\n\r\n", b"GET /health HTTP/3.1\r\nHost: x\r\n\r\n", b"GET /gen\x00erate HTTP/1.1\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", b"GET /health HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n",
    b"POST /generate HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
]


def _route_table(model_dir: Path) -> dict[str, set[str]]:
    """path -> methods of the engine's app, read from its router (the model is loaded, nothing is served)."""
    from kora_engine.lm.model import EngineModel
    from kora_engine.lm.server import HFEngineServer

    server = HFEngineServer(EngineModel(str(model_dir), "cpu"))
    try:
        routes: dict[str, set[str]] = {}
        for route in server.app().router.routes():
            routes.setdefault(route.resource.canonical, set()).add(route.method)  # type: ignore[union-attr]
        return routes
    finally:
        server.pool.shutdown()
        server.sync_pool.shutdown()


def engine_cases(routes: dict[str, set[str]]) -> list[Hostile]:
    cases: list[Hostile] = []
    for path, served in sorted(routes.items()):
        fields = ({name: f.annotation for name, f in BODY_MODELS[path].model_fields.items()}
                  if path in BODY_MODELS else FAST_SYNC_FIELDS.get(path))
        if fields is not None or path == "/generate":
            for method in sorted(served - {"HEAD"}):
                cases += body_cases(path, method, ENGINE_LIMIT)
            cases += framing_cases(path, 408 if path in ("/generate", "/load_lora_adapter") else None, None, True)
        if fields is not None:
            cases += typed_cases(path, fields)
        cases += method_cases(path, [m for m in METHODS if m not in served])
        cases.append(Hostile(f"FOO {path}", request("FOO", path, b"{}"), "FOO", text_ok=True))
    cases += json_cases("/generate", GENERATE_BAD)
    cases += [Hostile(f"GET /flush_cache?timeout={t}", request("GET", f"/flush_cache?timeout={t}"), "GET")
              for t in ("abc", "nan", "inf", "1e400", "")]
    cases += [Hostile(f"GET {p}", request("GET", p), "GET", frozenset({404}))
              for p in ("/nope", "/generate/x", "/%ff%fe", "/..%2f..%2fetc%2fpasswd", "/" + "a" * 5000)]
    cases += [Hostile(f"garbage {g[:30]!r}", g, "GET", text_ok=True) for g in PROTOCOL_GARBAGE]
    return cases


def control_plane_cases(data: str) -> list[Hostile]:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    runs = "/adapter_runs"
    good = {"rank": 8, "data": {"path": data}, "numSteps": 3}
    cases: list[Hostile] = []
    for path, served in (("/status", {"GET", "HEAD"}), ("/healthz", {"GET", "HEAD"}), (runs, {"GET", "POST"}),
                         (f"{runs}/state", {"GET"}), (f"{runs}/nobody", {"GET", "DELETE"})):
        methods = [m for m in METHODS if m not in served]
        cases += [Hostile(f"{m} {path}", request(m, path, b"{}" if m not in ("HEAD", "TRACE") else b"", auth), m,
                          frozenset({404, 405})) for m in methods]
        cases.append(Hostile(f"FOO {path}", request("FOO", path, b"", auth), "FOO", frozenset({404, 405})))
        cases.append(Hostile(f"GET {path} with a {MAX_BODY + 1}-byte body",
                             request("GET", path, b" " * (MAX_BODY + 1), auth), "GET", frozenset({413})))
    cases += [Hostile(c.name, c.data.replace(b"Connection: close\r\n", b"Connection: close\r\nAuthorization: "
                                             + f"Bearer {TOKEN}".encode() + b"\r\n", 1), c.method, c.expect)
              for c in body_cases(runs, "POST", MAX_BODY)]
    cases.append(Hostile(f"POST {runs} 10 MB", request("POST", runs, b"x" * 10_000_000, auth), "POST",
                         frozenset({413})))
    cases += json_cases(runs, [
        {"name": 5, "config": good}, {"name": "Bad_Name", "config": good}, {"name": "a" * 300, "config": good},
        {"name": "a", "config": "x"}, {"name": "a", "config": []}, {"name": "a"}, {"config": good},
        {"name": "a", "config": {**good, "rank": "x"}}, {"name": "a", "config": {**good, "rank": -1}},
        {"name": "a", "config": {**good, "rank": 10**30}}, {"name": "a", "config": {**good, "rank": 1e30}},
        {"name": "a", "config": {**good, "lr": "x"}}, {"name": "a", "config": {**good, "data": 5}},
        {"name": "a", "config": {**good, "numSteps": -3}}, {"name": "a", "config": {**good, "numSteps": 0}},
        {"name": "kora-policy", "config": good}, {"name": "a", "config": {**good, "extra": 1}},
    ], headers=auth)
    cases += json_cases(runs, [{"name": "a", "config": good}])  # no token
    cases += json_cases(runs, [{"name": "a", "config": good}], headers={"Authorization": "Bearer wrong"})
    cases += json_cases(runs, [{"name": "a", "config": good}], headers={"Authorization": f"Basic {TOKEN}"})
    cases += [Hostile(f"GET {p}", request("GET", p, b"", auth), "GET", frozenset({404}))
              for p in (f"{runs}/%00", f"{runs}/a/b", f"{runs}/" + "a" * 60_000, "/nope", "/st\xe4tus", "/")]
    cases += [Hostile(f"DELETE {p}", request("DELETE", p, b"", auth), "DELETE", frozenset({404, 405}))
              for p in (f"{runs}/nobody", f"{runs}/state", runs)]
    framing = framing_cases(runs, 408, 400, False)
    cases += [Hostile(c.name, c.data.replace(b"Connection: close\r\n", b"Connection: close\r\nAuthorization: "
                                             + f"Bearer {TOKEN}".encode() + b"\r\n", 1), c.method, c.expect,
                      half_close=c.half_close) for c in framing]
    cases += [Hostile(f"garbage {g[:30]!r}", g, "GET") for g in (
        b"GARBAGE\r\n\r\n", b"GET /status HTTP/2.0\r\n\r\n", b"GET /status HTTP/x.y\r\n\r\n",
        b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
        b"GET /status HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n",
        b"GET /status HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n")]
    return cases


def _record(name: str, outcomes: list[Outcome]) -> dict:
    figures = tally(outcomes)
    print(f"\n{name}: {json.dumps(figures)}")
    return figures


def _check(outcomes: list[Outcome]) -> None:
    problems = [f"{o.case.name}: {p}" for o in outcomes if (p := o.problem()) is not None]
    assert not problems, f"{len(problems)} of {len(outcomes)} hostile requests broke the rule:\n" + \
        "\n".join(problems[:40])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def figures():
    out: dict = {}
    yield out
    target = os.environ.get("KORA_HOSTILE_RECORD")
    if target and out:
        Path(target).write_text(json.dumps(out, indent=2) + "\n")


def test_the_engine_answers_every_hostile_request_with_a_4xx_and_keeps_serving(model_dir, tmp_path, figures):
    routes = _route_table(model_dir)
    assert {"/generate", "/health", "/load_lora_adapter", "/kora/fast_sync/plan"} <= set(routes)
    cases = engine_cases(routes)
    engine = start_engine(model_dir, tmp_path, "--max-body-bytes", str(ENGINE_LIMIT), "--body-timeout-s", "1")
    try:
        with EngineClient(engine.url, timeout=60) as client:
            greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
            before = client.generate(PROMPTS, greedy)
            port = int(engine.url.rsplit(":", 1)[1])
            outcomes = barrage(port, cases, TIMEOUT_S)
            assert engine.proc.poll() is None, "the engine died"
            # serves normally afterwards, and no hostile request changed anything
            assert client.health()
            after = client.generate(PROMPTS, greedy)
            assert [o.output_ids for o in after] == [o.output_ids for o in before]
            assert [o.output_logprobs for o in after] == [o.output_logprobs for o in before]
            state = client.request("GET", "/kora/state")
            assert (state["in_flight"], state["held_requests"], state["adapters"]) == (0, 0, {})
            assert client.model_info()["weight_version"] == "default"
    finally:
        stop_engine(engine)
    figures["engine"] = _record("reference engine", outcomes)
    assert len(outcomes) >= 200
    _check(outcomes)
    by_name = {o.case.name: o for o in outcomes}
    assert "greater than the vocab size (16)" in by_name[f"POST /generate {json.dumps({'input_ids': [99]})}"].message()
    over = by_name[f"POST /generate {json.dumps({**ONE, 'sampling_params': {'max_new_tokens': 10**12}})}"]
    assert over.message().startswith("Requested token count exceeds the model's maximum context length of 256")


def test_the_control_plane_answers_every_hostile_request_with_a_4xx_and_keeps_serving(tmp_path, figures):
    registry, data = multi_adapter_registry(tmp_path)
    progress = Progress(5, "Adapter")
    progress.update(step=2, rewardMean=0.5)
    cp = ControlPlane(progress, TOKEN, port=0, host="127.0.0.1", routes=AdapterRunsAPI(registry),
                      read_timeout_s=1.0).start()
    try:
        port = int(cp.url.rsplit(":", 1)[1])
        cases = control_plane_cases(str(data))
        outcomes = barrage(port, cases, TIMEOUT_S)
        assert cp.thread.is_alive()
        # serves normally afterwards, and no hostile request registered anything
        auth = {"Authorization": f"Bearer {TOKEN}"}
        ok = Hostile("GET /status", request("GET", "/status", b"", auth), "GET")
        status = barrage(port, [ok], TIMEOUT_S)[0]
        assert status.status == 200 and json.loads(status.body)["step"] == 2
        assert registry.listing().adapters == []
        good = {"name": "a", "config": {"rank": 8, "data": {"path": str(data)}, "numSteps": 3}}
        created = barrage(port, json_cases("/adapter_runs", [good], headers=auth), TIMEOUT_S)[0]
        assert created.status == 201, created.body
    finally:
        cp.stop()
    figures["control_plane"] = _record("control plane", outcomes)
    assert len(outcomes) >= 100
    _check(outcomes)
    by_name = {o.case.name: o for o in outcomes}
    assert "over the limit of 1048576 bytes" in by_name["POST /adapter_runs 10 MB"].message()
