"""EngineClient pieces that need no engine: error parsing for every SGLang error shape, output
parsing, the per-bucket checksum, and the failure of a server that is not there."""

from __future__ import annotations

import pytest
import torch

from kora_trainer.wire.engine_client import EngineClient, EngineError, GenerateOutput, applied_checksum, error_message
from kora_trainer.wire.ports import free_port
from kora_trainer.wire.protocol import checksum, plan_buckets


@pytest.mark.parametrize(("body", "text", "expected"), [
    ({"error": {"message": "Got LoRA adapter that has never been loaded: x"}}, "", "Got LoRA adapter that has never "
                                                                                   "been loaded: x"),
    ({"error": "unknown field `max_tokens`, expected one of ..."}, "",
     "unknown field `max_tokens`, expected one of ..."),
    ({"object": "error", "message": "Field required", "type": "Bad Request", "param": None, "code": 400}, "",
     "Field required"),
    ({"success": False, "message": "The group to be destroyed does not exist."}, "",
     "The group to be destroyed does not exist."),
    ({"rid": None, "success": False, "error_message": "already loaded", "loaded_adapters": {}}, "", "already loaded"),
    ("Flush cache failed.\n", "Flush cache failed.\n", "Flush cache failed."),
    ({"error": "Unauthorized"}, "", "Unauthorized"),
])
def test_error_message_reads_every_sglang_error_shape(body, text, expected):
    assert error_message(body, text) == expected


def test_generate_output_parses_sglangs_shape():
    item = {"text": "12", "output_ids": [4, 5], "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
        "weight_version": "v3", "output_token_logprobs": [[-0.5, 4, None], [-1.25, 5, None]]}}
    out = GenerateOutput.from_json(item)
    assert out.output_ids == [4, 5] and out.output_logprobs == [-0.5, -1.25]
    assert out.finish_reason == {"type": "length", "length": 2} and out.weight_version == "v3"
    assert out.prompt_tokens == 3
    bare = GenerateOutput.from_json({"output_ids": [1], "meta_info": {}})  # --skip-tokenizer-init: no text
    assert bare.text is None and bare.output_logprobs == []


def test_applied_checksum_counts_a_split_tensor_in_its_last_bucket():
    named = [("a", torch.arange(300, dtype=torch.float32)), ("b", torch.ones(10, dtype=torch.bfloat16))]
    buckets = plan_buckets([[nt] for nt in named], 500)  # 'a' (1200 bytes) spans three buckets
    tensors = dict(named)
    # buckets: a[0:500] | a[500:1000] | a[1000:1200] + b
    assert [applied_checksum(b.metadata(), tensors) for b in buckets] == [checksum([]), checksum([]), checksum(named)]


def test_a_missing_server_is_an_engine_error_with_status_0():
    with EngineClient(f"http://127.0.0.1:{free_port()}", connect_timeout=2, timeout=2) as c:
        assert c.health(timeout=1) is False
        with pytest.raises(EngineError) as err:
            c.model_info()
        assert err.value.status == 0 and err.value.route == "/model_info"
        with pytest.raises(TimeoutError):
            c.wait_healthy(timeout_s=0.5, interval_s=0.1)
