"""Each SGLang build's request structs as that build's source spells them, and a check of recorded calls against
them (the strict-build tests: tests/unit/test_sglang_build_*.py, tests/e2e/test_sglang_build_matrix.py).

Written from the sources, not from kora's models, so a kora field that leaks into a request is caught:
- `0.5.23`: ../shared/SGLANG_API.md (the wheel's io_struct.py lines: IO:176 GenerateReqInput, IO:2002, IO:2027,
  IO:2126, IO:2146, IO:2516, IO:2535, IO:2548, IO:1927, IO:1949); `AbortReq` and `UpdateWeightVersionReqInput` from
  upstream main @ 18e6c61c (io_struct.py).
- `sglang-miles-94949da7`: python/sglang/srt/managers/io_struct.py @ 94949da735cc04bf20b542d18bafff06d3f1b49f
  (IO:1582 UpdateWeightsFromDistributedReqInput, IO:1608 UpdateWeightsFromTensorReqInput, IO:1721 / 1741 the group,
  IO:1750 UpdateWeightVersionReqInput, IO:1812 AbortReq (+ prefix), IO:1995 / 2014 / 2027 the LoRA routes,
  IO:2048 LoadLoRAAdapterFromDistributedReqInput).
- `0.5.17`: the PyPI wheel's sglang/srt/managers/io_struct.py (IO:1676 UpdateWeightsFromDistributedReqInput and
  IO:1699 UpdateWeightsFromTensorReqInput: no `selector`, the tensor route has `disable_draft_model`; IO:1798 / 1814
  the group, IO:1827 UpdateWeightVersionReqInput, IO:1906 AbortReq (no `prefix`), IO:2113 / 2132 / 2145 the LoRA
  routes, IO:1601 PauseGenerationReqInput; GenerateReqInput has `image_data` and the fields tabled below).
Every struct but GenerateReqInput also has BaseReq's `rid` and `http_worker_ipc`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STOCK, STOCK_0_5_17, MILES = "0.5.23", "0.5.17", "sglang-miles-94949da7"
BASE_REQ = {"rid", "http_worker_ipc"}

# GenerateReqInput: the fields SGLANG_API.md tables (the struct has more; kora sends none of the others)
GENERATE = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
            "token_ids_logprob", "return_text_in_logprobs", "stream", "lora_path", "rid", "return_prompt_token_ids"}
_WEIGHTS = {"flush_cache", "abort_all_requests", "weight_version", "load_format", "selector", "torch_empty_cache"}

# route -> (required fields, optional fields)
_STOCK_STRUCTS: dict[str, tuple[set[str], set[str]]] = {
    "/generate": (set(), GENERATE),
    "/init_weights_update_group": ({"master_address", "master_port", "rank_offset", "world_size"},
                                   {"group_name", "backend"}),
    "/destroy_weights_update_group": (set(), {"group_name"}),
    "/update_weights_from_distributed": ({"names", "dtypes", "shapes"}, {"group_name", *_WEIGHTS}),
    "/update_weights_from_tensor": ({"serialized_named_tensors"}, _WEIGHTS),
    "/load_lora_adapter": ({"lora_name", "lora_path"}, {"pinned", "lora_id"}),
    "/unload_lora_adapter": ({"lora_name"}, {"lora_id"}),
    "/load_lora_adapter_from_tensors": ({"lora_name", "config_dict", "serialized_named_tensors"},
                                        {"pinned", "added_tokens_config", "lora_id", "load_format",
                                         "expected_checksums"}),
    "/update_weight_version": ({"new_version"}, {"abort_all_requests"}),
    "/abort_request": (set(), {"abort_all", "finished_reason", "abort_message"}),
    "/pause_generation": (set(), {"mode"}),
    "/continue_generation": (set(), {"torch_empty_cache"}),
}
_MILES_STRUCTS = {
    **_STOCK_STRUCTS,
    "/load_lora_adapter_from_tensors": (_STOCK_STRUCTS["/load_lora_adapter_from_tensors"][0],
                                        _STOCK_STRUCTS["/load_lora_adapter_from_tensors"][1] | {"upsert"}),
    "/load_lora_adapter_from_distributed": ({"lora_name", "config_dict", "names", "dtypes", "shapes"},
                                            {"group_name", "pinned", "added_tokens_config", "lora_id", "upsert"}),
    "/abort_request": (set(), _STOCK_STRUCTS["/abort_request"][1] | {"prefix"}),
}
_WEIGHTS_0_5_17 = _WEIGHTS - {"selector"}
_STOCK_0_5_17_STRUCTS = {
    **_STOCK_STRUCTS,
    "/generate": (set(), GENERATE | {"image_data"}),
    "/update_weights_from_distributed": ({"names", "dtypes", "shapes"}, {"group_name", *_WEIGHTS_0_5_17}),
    "/update_weights_from_tensor": ({"serialized_named_tensors"}, _WEIGHTS_0_5_17 | {"disable_draft_model"}),
}
STRUCTS: dict[str, dict[str, tuple[set[str], set[str]]]] = {
    STOCK: _STOCK_STRUCTS, STOCK_0_5_17: _STOCK_0_5_17_STRUCTS, MILES: _MILES_STRUCTS}
BODYLESS = {"/health", "/health_generate", "/model_info", "/get_model_info", "/flush_cache"}


def read_calls(path: Path) -> list[dict[str, Any]]:
    """The engine's record (kora_engine/lm/record.py): one dict per answered request."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def call_problems(build: str, calls: list[dict[str, Any]]) -> list[str]:
    """Every call to a route `build` lacks, or with a field its struct lacks, or without a required one."""
    structs = STRUCTS[build]
    problems = []
    for c in calls:
        path, body = c["path"], c["body"]
        if path in BODYLESS:
            continue
        if path not in structs:
            problems.append(f"{c['method']} {path}: sglang {build} has no such route (answered {c['status']})")
            continue
        required, optional = structs[path]
        extra = BASE_REQ if path != "/generate" else set()
        keys = set(body) if isinstance(body, dict) else set()
        unknown = keys - required - optional - extra
        if unknown:
            problems.append(f"{path}: fields sglang {build} does not have: {sorted(unknown)}")
        if required - keys:
            problems.append(f"{path}: required fields missing: {sorted(required - keys)}")
    return problems
