"""Request bodies as strict JSON (RFC 8259), for every HTTP server of kora: the reference engine and the
trainer's control plane.

Python's `json.loads` is lenient where a hostile or broken client should be told what is wrong instead: it
reads NaN, Infinity and an overflowing number (1e999 becomes inf), which a sampler, an optimizer or a
pydantic float field would then take; it raises RecursionError on deep nesting; and bytes that are not UTF-8
raise UnicodeDecodeError, which is not a JSONDecodeError. `loads_body` turns every one of these into a
`BodyError` whose message names the problem and the fix, for the server to answer with a 400.
"""

from __future__ import annotations

import json
import math
from typing import Any


class BodyError(ValueError):
    """The body is not strict JSON; the message says why (a 400 for the server)."""


def _not_finite(constant: str) -> Any:
    raise BodyError(f"{constant} is not a JSON number (RFC 8259): send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(f"{text} is out of the range of a double: send a finite number")
    return value


def loads_body(raw: bytes) -> Any:
    """`raw` parsed as strict JSON, or BodyError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"the body is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}): "
                        "send the JSON encoded as UTF-8") from None
    try:
        return json.loads(text, parse_constant=_not_finite, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise BodyError(str(e)) from None
    except RecursionError:
        raise BodyError("the body is nested too deeply") from None
