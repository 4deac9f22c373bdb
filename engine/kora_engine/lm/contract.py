"""SGLang's JSON contract gate for `/generate`, reproduced for the reference engine.

sglang 0.5.23 decodes every `/generate` body a second time with the generated
`sglang/api/v1/api_types.py` (`GenerateRequest.from_json_value`, called from
`sglang/srt/entrypoints/api_contract.py`) before running it. Unknown top-level keys pass, but an
unknown key inside `sampling_params`, or a value of the wrong JSON type, is refused with
**400 `{"error": "<serde-style text>"}`** — `error` is a plain string there. A trainer that sends
`max_tokens` instead of `max_new_tokens` must fail here exactly as it would on SGLang, so this
module copies the decoder's checks and its error texts (`_unexpected`, `_invalid_type`,
`_unknown_field`), not its code.

An integer outside its field's type (i32 token ids, i64 counts) is refused in serde's words for it, e.g.
"invalid value: integer `4294967296`, expected i32" (serde's wording ⚠: not checked against the decoder's own).

The allowed sampling keys are `_FIELDS_SamplingParams` in that order; 0.5.23 adds `watermark`
(SGLANG_API.md §1) and lists `choice` ⚠ (its position in the list is not pinned down).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SAMPLING_FIELDS: tuple[str, ...] = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)


class ContractError(ValueError):
    """The body violates SGLang's JSON contract (HTTP 400 `{"error": str(e)}`)."""


def _unexpected(v: Any) -> str:
    """serde's `Unexpected` display."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _invalid(v: Any, expected: str) -> ContractError:
    return ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def unknown_field(key: str, fields: tuple[str, ...]) -> ContractError:
    if len(fields) == 1:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}`")
    if len(fields) == 2:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}` or `{fields[1]}`")
    listed = ", ".join(f"`{f}`" for f in fields)
    return ContractError(f"unknown field `{key}`, expected one of {listed}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> None:
    if not (_is_int(v) or isinstance(v, float)):
        raise _invalid(v, "f64")


_INT_RANGES = {"i32": (-(1 << 31), (1 << 31) - 1), "i64": (-(1 << 63), (1 << 63) - 1)}


def _integer(v: Any, expected: str = "i64") -> None:
    if not _is_int(v):
        raise _invalid(v, expected)
    low, high = _INT_RANGES[expected]
    if not low <= v <= high:  # serde's `invalid_value` for an integer its target type cannot hold
        raise ContractError(f"invalid value: integer `{v}`, expected {expected}")


def _boolean(v: Any) -> None:
    if not isinstance(v, bool):
        raise _invalid(v, "a boolean")


def _string(v: Any) -> None:
    if not isinstance(v, str):
        raise _invalid(v, "a string")


def _seq(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise _invalid(v, "a sequence")
    return v


def _one_or_list(scalar: Callable[[Any], None], alias: str) -> Callable[[Any], None]:
    """`XOrList`: a list checks each element; anything else must be the scalar (with the alias's text)."""

    def check(v: Any) -> None:
        if isinstance(v, list):
            for e in v:
                scalar(e)
            return
        try:
            scalar(v)
        except ContractError:
            raise _invalid(v, f"a value or an array of values for {alias}") from None

    return check


def _token_ids(v: Any) -> None:
    for e in _seq(v):
        _integer(e, "i32")


def _token_ids_or_list(v: Any) -> None:
    if not isinstance(v, list):
        raise _invalid(v, "a value or an array of values for TokenIdsOrList")
    if not v or (_is_int(v[0]) or isinstance(v[0], float)):
        _token_ids(v)
    else:
        for e in v:
            _token_ids(e)


def _int64_list(v: Any) -> None:
    for e in _seq(v):
        _integer(e)


def _logit_bias(v: Any) -> None:
    if not isinstance(v, dict):
        raise _invalid(v, "a map")
    for e in v.values():
        _number(e)


def _anything(v: Any) -> None:
    return None


_string_or_list = _one_or_list(_string, "StringOrList")

_SAMPLING_CHECKS: dict[str, Callable[[Any], None]] = {
    "max_new_tokens": _integer, "stop": _string_or_list, "stop_token_ids": _int64_list,
    "stop_regex": _string_or_list, "temperature": _number, "top_p": _number, "top_k": _integer, "min_p": _number,
    "frequency_penalty": _number, "presence_penalty": _number, "repetition_penalty": _number,
    "min_new_tokens": _integer, "n": _integer, "json_schema": _string, "regex": _string, "ebnf": _string,
    "structural_tag": _string, "ignore_eos": _boolean, "skip_special_tokens": _boolean,
    "spaces_between_special_tokens": _boolean, "no_stop_trim": _boolean, "stream_interval": _integer,
    "logit_bias": _logit_bias, "sampling_seed": _integer, "custom_params": _anything, "beam_width": _integer,
    "watermark": _anything, "choice": _anything,
}


def check_sampling_params(v: Any) -> None:
    if not isinstance(v, dict):
        raise _invalid(v, "struct SamplingParams")
    for key, x in v.items():
        check = _SAMPLING_CHECKS.get(key)
        if check is None:
            raise unknown_field(key, SAMPLING_FIELDS)
        if x is not None:
            check(x)


def _sampling_params_or_list(v: Any) -> None:
    if isinstance(v, list):
        for e in v:
            check_sampling_params(e)
    elif isinstance(v, dict):
        check_sampling_params(v)
    else:
        raise _invalid(v, "a value or an array of values for SamplingParamsOrList")


_REQUEST_CHECKS: dict[str, Callable[[Any], None]] = {
    "rid": _string_or_list,
    "text": _string_or_list,
    "input_ids": _token_ids_or_list,
    "stream": _boolean,
    "sampling_params": _sampling_params_or_list,
    "return_logprob": _one_or_list(_boolean, "BoolOrList"),
    "logprob_start_len": _one_or_list(_integer, "Int64OrList"),
    "top_logprobs_num": _one_or_list(_integer, "Int64OrList"),
    "token_ids_logprob": _token_ids_or_list,
    "return_hidden_states": _one_or_list(_boolean, "BoolOrList"),
    "return_text_in_logprobs": _boolean,
}


def generate_contract_error(body: Any) -> str | None:
    """The contract violation in a parsed `/generate` body, or None (unknown top-level keys pass)."""
    try:
        if not isinstance(body, dict):
            raise _invalid(body, "struct GenerateRequest")
        for key, x in body.items():
            check = _REQUEST_CHECKS.get(key)
            if check is not None and x is not None:
                check(x)
    except ContractError as e:
        return str(e)
    return None
