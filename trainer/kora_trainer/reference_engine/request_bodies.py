"""Request bodies of the engine routes: fields, types, defaults — and SGLang's error bodies.

Each table below copies a request struct of sglang 0.5.23 (`sglang/srt/managers/io_struct.py`,
see SGLANG_API.md for the lines): a field without a default is required, unknown keys are
ignored, and a missing or mistyped field is answered like SGLang's FastAPI validation handler —
400 `{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}`.
Fields marked *kora* are kora's additions; a stock SGLang ignores them (unknown keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REQUIRED: Any = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_TYPES: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "float": lambda v: _is_int(v) or isinstance(v, float),
    "bool": lambda v: isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(e, str) for e in v),
    "list[list[int]]": lambda v: isinstance(v, list) and all(
        isinstance(e, list) and all(_is_int(x) for x in e) for e in v),
    "any": lambda v: True,
}


@dataclass(frozen=True)
class F:
    type: str
    default: Any = REQUIRED
    nullable: bool = False


class BadRequest(Exception):
    """A body that does not parse into the route's struct."""


def parse(struct: str, fields: dict[str, F], body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"1 validation error for {struct}\n  Input should be a valid dictionary "
                         f"[type=dict_type, input_value={body!r}]")
    out: dict[str, Any] = {}
    errors: list[str] = []
    for name, f in fields.items():
        if name not in body:
            if f.default is REQUIRED:
                errors.append(f"body.{name}\n  Field required [type=missing]")
            else:
                out[name] = f.default
            continue
        v = body[name]
        if v is None and (f.nullable or f.default is None):
            out[name] = None
        elif v is None or not _TYPES[f.type](v):
            errors.append(f"body.{name}\n  Input should be of type {f.type} [type=type_error, input_value={v!r}]")
        else:
            out[name] = v
    if errors:
        raise BadRequest(f"{len(errors)} validation error{'s' if len(errors) > 1 else ''} for {struct}\n"
                         + "\n".join(errors))
    return out


def bad_request_body(message: str) -> dict[str, Any]:
    """HS `validation_exception_handler`: FastAPI's 422 remapped to 400."""
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def value_error_body(message: str) -> dict[str, Any]:
    """HS `_create_error_response`: a ValueError in a handler."""
    return {"error": {"message": message}}


def lora_update_output(success: bool, error_message: str | None, loaded: dict[str, str]) -> dict[str, Any]:
    """IO `LoRAUpdateOutput` serialized with its BaseReq fields."""
    return {"rid": None, "http_worker_ipc": None, "success": success, "error_message": error_message,
            "loaded_adapters": loaded}


GROUP = "weight_update_group"

INIT_WEIGHTS_UPDATE_GROUP = {
    "master_address": F("str"), "master_port": F("int"), "rank_offset": F("int"), "world_size": F("int"),
    "group_name": F("str", GROUP), "backend": F("str", "nccl"),
}
DESTROY_WEIGHTS_UPDATE_GROUP = {"group_name": F("str", GROUP)}

# kora: EngineMerge — the bucket holds PEFT lora_A/lora_B pairs to fold into the pristine base
_LORA_MERGE = {
    "weight_update_mode": F("str", None), "lora_alpha": F("float", None), "lora_rank": F("int", None),
    "merge_fp32": F("bool", True),
}
UPDATE_WEIGHTS_FROM_DISTRIBUTED = {
    "names": F("list[str]"), "dtypes": F("list[str]"), "shapes": F("list[list[int]]"),
    "group_name": F("str", GROUP), "flush_cache": F("bool", True), "abort_all_requests": F("bool", False),
    "weight_version": F("str", None), "load_format": F("str", None), "selector": F("str", "all"),
    "torch_empty_cache": F("bool", False),
    "byte_ranges": F("list[list[int]]", None),  # kora: byte range of each piece (tensors split over buckets)
    **_LORA_MERGE,
}
UPDATE_WEIGHTS_FROM_TENSOR = {
    "serialized_named_tensors": F("list[str]"), "load_format": F("str", None), "flush_cache": F("bool", True),
    "abort_all_requests": F("bool", False), "weight_version": F("str", None), "selector": F("str", "all"),
    "torch_empty_cache": F("bool", False),
    **_LORA_MERGE,
}
LOAD_LORA_ADAPTER = {
    "lora_name": F("str"), "lora_path": F("str"), "pinned": F("bool", False), "lora_id": F("str", None),
}
UNLOAD_LORA_ADAPTER = {"lora_name": F("str"), "lora_id": F("str", None)}
LOAD_LORA_ADAPTER_FROM_TENSORS = {
    "lora_name": F("str"), "config_dict": F("dict"), "serialized_named_tensors": F("list[str]"),
    "pinned": F("bool", False), "added_tokens_config": F("dict", None), "lora_id": F("str", None),
    "load_format": F("str", None), "expected_checksums": F("dict", None),
}
# kora extension: adapter tensors over the weight-update group, bucketed, upserted after the last bucket
LOAD_LORA_ADAPTER_FROM_DISTRIBUTED = {
    "lora_name": F("str"), "config_dict": F("dict"), "names": F("list[str]"), "dtypes": F("list[str]"),
    "shapes": F("list[list[int]]"), "byte_ranges": F("list[list[int]]", None), "group_name": F("str", GROUP),
    "load_format": F("str", None), "bucket_index": F("int", 0), "num_buckets": F("int", 1),
    "weight_version": F("str", None),
}
# SGLang UpdateWeightVersionReqInput: sets the version /generate reports in meta_info.weight_version
UPDATE_WEIGHT_VERSION = {"new_version": F("str"), "abort_all_requests": F("bool", False)}
PAUSE_GENERATION = {"mode": F("str", "abort")}
CONTINUE_GENERATION = {"torch_empty_cache": F("bool", True)}
