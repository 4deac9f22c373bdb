"""The base class of every config/API model: camelCase on the wire, strict about unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class CamelModel(BaseModel):
    """Fields are snake_case in Python and camelCase in YAML/JSON (the CRD's spelling).

    Field docstrings become the schema descriptions, so `kubectl explain` shows the text written
    beside each field.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        frozen=True,
    )
