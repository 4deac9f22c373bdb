"""Request bodies of the engine routes as pydantic models — and SGLang's error bodies.

Each model copies a request struct of sglang 0.5.23 (`sglang/srt/managers/io_struct.py`, see
SGLANG_API.md for the lines) under the struct's own name (pydantic puts it in the error title): a
field without a default is required, unknown keys are ignored, and a missing or mistyped field is
answered like SGLang's FastAPI validation handler — 400 `{"object": "error", "message", "type":
"Bad Request", "param": null, "code": 400}`, the message built from pydantic's errors as FastAPI
reports them (every location under `body`). Fields marked *kora* are kora's additions; a stock
SGLang ignores them (unknown keys).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kora_trainer.wire.strict_json import BodyError, loads_body


class BadRequest(Exception):
    """A body that does not parse into the route's struct (server.py answers it with `bad_request_body`)."""


class ReqInput(BaseModel):
    # strict: no coercion ("3" is no int, 1 is no bool): a sender's type slip is refused, not guessed at
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


Body = TypeVar("Body", bound=ReqInput)


def validation_message(err: ValidationError) -> str:
    """The text of SGLang's 400 for a body that failed validation, from pydantic's own error list."""
    errors = err.errors(include_url=False)
    lines = [f"{len(errors)} validation error{'s' if len(errors) > 1 else ''} for {err.title}"]
    for e in errors:
        where = ".".join(["body", *(str(part) for part in e["loc"])])
        # a missing field's input is the whole body (maybe megabytes of serialized tensors): not echoed
        shown = "" if e["type"] == "missing" else f", input_value={e['input']!r}"
        lines.append(f"{where}\n  {e['msg']} [type={e['type']}{shown}]")
    return "\n".join(lines)


def json_body(raw: bytes) -> Any:
    """A request body as strict JSON (wire/strict_json.py), or BadRequest: FastAPI's "JSON decode error" 400
    for what is not JSON, also for bytes that are not UTF-8 and for NaN / Infinity / an overflowing number."""
    try:
        return loads_body(raw)
    except BodyError as e:
        raise BadRequest(f"JSON decode error: {e}") from None


def parse(model: type[Body], body: Any) -> Body:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise BadRequest(validation_message(e)) from None


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


class GenerateReqInput(ReqInput):
    """The one field of `GenerateReqInput` that the contract gate (contract.py) leaves unchecked."""

    lora_path: list[str | None] | str | None = None
    rid: list[str] | str | None = None  # a batch's string rid becomes f"{rid}_{i}"; absent: a uuid4 hex each


class InitWeightsUpdateGroupReqInput(ReqInput):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = GROUP
    backend: str = "nccl"


def group_problem(b: InitWeightsUpdateGroupReqInput) -> str | None:
    """What makes a join impossible, found before joining (kora's check; SGLang would try, and wait): the trainer is
    rank 0, so this engine's rank `rank_offset` must be in [1, world_size)."""
    if not 1 <= b.master_port <= 65535:
        return f"master_port must be in [1, 65535], got {b.master_port}"
    if b.world_size < 2:
        return f"world_size must be at least 2 (the trainer and this engine), got {b.world_size}"
    if not 1 <= b.rank_offset < b.world_size:
        return f"rank_offset must be in [1, world_size={b.world_size}) (rank 0 is the trainer), got {b.rank_offset}"
    return None


class DestroyWeightsUpdateGroupReqInput(ReqInput):
    group_name: str = GROUP


class WeightUpdate(ReqInput):
    """The fields both weight-update structs share (pydantic lists a base's fields, and their errors, first)."""

    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False
    # kora: EngineMerge — the bucket holds PEFT lora_A/lora_B pairs to fold into the pristine base
    weight_update_mode: str | None = None
    lora_alpha: float | None = None
    lora_rank: int | None = None
    merge_fp32: bool = True


class UpdateWeightsFromDistributedReqInput(WeightUpdate):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = GROUP
    byte_ranges: list[list[int]] | None = None  # kora: byte range of each piece (tensors split over buckets)


class UpdateWeightsFromTensorReqInput(WeightUpdate):
    serialized_named_tensors: list[str]


class LoadLoRAAdapterReqInput(ReqInput):
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class UnloadLoRAAdapterReqInput(ReqInput):
    lora_name: str
    lora_id: str | None = None


class LoadLoRAAdapterFromTensorsReqInput(ReqInput):
    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    added_tokens_config: dict[str, Any] | None = None
    lora_id: str | None = None
    load_format: str | None = None
    expected_checksums: dict[str, Any] | None = None


class LoadLoRAAdapterFromDistributedReqInput(ReqInput):
    """sglang-miles' route (#27268) + kora's buckets: adapter tensors over the weight-update group, bucketed,
    upserted after the last bucket (kora's fields are dropped in a build's strict mode: strict.py)."""

    lora_name: str
    config_dict: dict[str, Any]
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    byte_ranges: list[list[int]] | None = None
    group_name: str = GROUP
    load_format: str | None = None
    bucket_index: int = 0
    num_buckets: int = 1
    weight_version: str | None = None
    # sglang-miles' own fields (IO:2048 @ 94949da7): kora's route always upserts; a strict engine honours `upsert`
    pinned: bool = False
    added_tokens_config: dict[str, Any] | None = None
    lora_id: str | None = None
    upsert: bool = False


class UpdateWeightVersionReqInput(ReqInput):
    """Sets the version /generate reports in meta_info.weight_version."""

    new_version: str
    abort_all_requests: bool = False


class PauseGenerationReqInput(ReqInput):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortReq(ReqInput):
    """IO `AbortReq` (its BaseReq `rid`; `finished_reason` / `abort_message` are parsed but, as in SGLang's
    HTTP handler, unused) + `prefix` (sglang-miles #30912: abort every rid starting with `rid`)."""

    rid: str | None = None
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    prefix: bool = False


class ContinueGenerationReqInput(ReqInput):
    torch_empty_cache: bool = True
