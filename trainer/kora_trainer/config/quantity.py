"""Kubernetes resource quantities ("512Mi", "1G", 4096) as byte counts.

Written here rather than taken from kubernetes.utils.parse_quantity because the trainer config
must import no Kubernetes client (the trainer image and `kora validate` stay light).
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_SUFFIX = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
_RE = re.compile(QUANTITY_PATTERN)


def parse_bytes(value: Any) -> int:
    """'512Mi' -> 536870912. Raises ValueError naming the accepted forms."""
    if isinstance(value, bool):
        raise ValueError("expected a byte quantity such as 536870912, '512Mi' or '1Gi'")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("must be a positive number of bytes")
        return value
    text = str(value).strip()
    m = _RE.match(text)
    if not m:
        raise ValueError(f"{value!r} is not a byte quantity; use e.g. 536870912, '512Mi' or '1Gi'")
    suffix = m.group(2) or ""
    number = Decimal(text[: len(text) - len(suffix)])
    n = int(number * _SUFFIX[suffix])
    if n <= 0:
        raise ValueError("must be a positive number of bytes")
    return n


def format_bytes(n: int) -> str | int:
    """The shortest exact binary-suffixed form (536870912 -> '512Mi'); plain int otherwise."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = _SUFFIX[suffix]
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return n


ByteQuantity = Annotated[
    int,
    BeforeValidator(parse_bytes),
    PlainSerializer(format_bytes, return_type=Any),
    WithJsonSchema(
        {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}
    ),
]
"""A byte count written as an integer or a Kubernetes quantity string."""
