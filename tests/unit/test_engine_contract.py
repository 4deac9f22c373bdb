"""The engine's request checks without a server: SGLang's contract gate texts, sampling defaults,
request-struct validation and the stop rules."""

from __future__ import annotations

import pytest

from kora_engine.lm import request_bodies as rq
from kora_engine.lm.contract import SAMPLING_FIELDS, generate_contract_error
from kora_engine.lm.sampling import TOP_K_ALL, SamplingParams, check_stop


def test_contract_gate_texts_are_serde_style():
    assert generate_contract_error({"input_ids": [1], "sampling_params": {"max_new_tokens": 3}}) is None
    assert generate_contract_error({"input_ids": [1], "whatever": 1}) is None  # unknown top-level keys pass
    listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
    assert generate_contract_error({"sampling_params": {"max_tokens": 3}}) == \
        f"unknown field `max_tokens`, expected one of {listed}"
    assert generate_contract_error({"sampling_params": [{"n": 1}, {"n": 1.5}]}) == \
        "invalid type: floating point `1.5`, expected i64"
    assert generate_contract_error({"sampling_params": {"ignore_eos": 1}}) == \
        "invalid type: integer `1`, expected a boolean"
    assert generate_contract_error({"input_ids": "12"}) == \
        'invalid type: string "12", expected a value or an array of values for TokenIdsOrList'
    assert generate_contract_error({"input_ids": [[1, 2], [3, "x"]]}) == 'invalid type: string "x", expected i32'
    assert generate_contract_error({"return_logprob": "yes"}) == \
        'invalid type: string "yes", expected a value or an array of values for BoolOrList'
    assert generate_contract_error([1]) == "invalid type: sequence, expected struct GenerateRequest"
    assert generate_contract_error({"sampling_params": {"temperature": None, "stop": ["a", "b"]}}) is None


def test_sampling_defaults_are_sglangs():
    p = SamplingParams.from_json(None)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.n) == (128, 1.0, 1.0, TOP_K_ALL, 0.0, 1)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_new_tokens) == (1.0, 0.0, 0.0, 0)
    assert not p.ignore_eos and p.skip_special_tokens and p.sampling_seed is None
    assert SamplingParams.from_json({"top_k": -1, "temperature": 0}).greedy
    assert SamplingParams.from_json({"stop": "x"}).stop == ["x"]
    for bad in ({"top_p": 0.0}, {"temperature": -1.0}, {"n": 0}, {"min_new_tokens": 5, "max_new_tokens": 2}):
        with pytest.raises(ValueError):
            SamplingParams.from_json(bad)
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams.from_json({"json_schema": "{}"})


def test_stop_rules_in_sglang_order():
    p = SamplingParams.from_json({"max_new_tokens": 3, "stop": ["+"], "min_new_tokens": 2})
    assert check_stop(p, [2], "", {2}, 100).finish_reason is None  # min_new_tokens first
    assert check_stop(p, [5, 2], "", {2}, 100).finish_reason == {"type": "stop", "matched": 2}
    assert check_stop(p, [5, 6, 7], "", {2}, 100).finish_reason == {"type": "length", "length": 3}
    stop = check_stop(p, [5, 13], "1+", {2}, 100)
    assert stop.finish_reason == {"type": "stop", "matched": "+"} and stop.trim_to == 1
    assert check_stop(SamplingParams.from_json({"ignore_eos": True}), [2], "", {2}, 100).finish_reason is None
    assert check_stop(SamplingParams.from_json({}), [5], "", {2}, 0).finish_reason == {"type": "length", "length": 1}


def test_request_structs_report_missing_and_mistyped_fields():
    out = rq.parse(rq.InitWeightsUpdateGroupReqInput,
                   {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "extra": 1})
    assert out.group_name == "weight_update_group" and out.backend == "nccl" and "extra" not in out.model_dump()
    with pytest.raises(rq.BadRequest, match="2 validation errors") as err:
        rq.parse(rq.LoadLoRAAdapterReqInput, {"lora_name": 3})
    assert "body.lora_name" in str(err.value) and "body.lora_path" in str(err.value)
    assert rq.bad_request_body("m") == {"object": "error", "message": "m", "type": "Bad Request", "param": None,
                                        "code": 400}
