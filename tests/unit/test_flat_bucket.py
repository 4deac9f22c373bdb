"""SGLang's flattened bucket (wire/flat_bucket.py): what a push of one flat tensor carries, and what the receiving
side refuses, naming why."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kora_trainer.wire import flat_bucket
from kora_trainer.wire.serialize import deserialize_payload, serialize_payload


def _named():
    gen = torch.Generator().manual_seed(0)
    return [("a.lora_A", torch.randn(4, 16, generator=gen)), ("a.lora_B", torch.randn(32, 4, generator=gen)),
            ("bias", torch.randn(7, generator=gen))]


def test_a_bucket_round_trips_through_the_same_host_payload_as_one_storage():
    named = _named()
    bucket = flat_bucket.flatten(named)
    assert bucket["flattened_tensor"].shape == (4 * 16 + 32 * 4 + 7,)
    assert [m.name for m in bucket["metadata"]] == ["a.lora_A", "a.lora_B", "bias"]
    # strict: unpickled with SGLang's allowlist of modules and read by attribute only, as SGLang reads it
    back = flat_bucket.unflatten(deserialize_payload(serialize_payload(bucket), strict=True), attrs_only=True)
    assert [n for n, _ in back] == [n for n, _ in named]
    assert all(torch.equal(t, u) for (_, t), (_, u) in zip(named, back, strict=True))
    # every tensor received is a view of ONE storage: one handle for the engine to open, whatever the count
    assert len({t.untyped_storage().data_ptr() for _, t in back}) == 1


def test_the_multi_dtype_layout_and_sglangs_metadata_objects_are_read():
    @dataclass
    class FlattenedTensorMetadata:  # sglang's dataclass, as a payload pickled by sglang carries it
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    w, ids = torch.randn(3, 5).to(torch.bfloat16), torch.arange(6, dtype=torch.int32)
    raw = torch.cat([w.view(-1).view(torch.uint8), ids.view(torch.uint8)])
    meta = [FlattenedTensorMetadata("w", w.shape, torch.bfloat16, 0, 30, 15),
            FlattenedTensorMetadata("ids", ids.shape, torch.int32, 30, 54, 6)]
    (n1, t1), (n2, t2) = flat_bucket.unflatten({"flattened_tensor": raw, "metadata": meta})
    assert (n1, n2) == ("w", "ids") and torch.equal(t1, w) and torch.equal(t2, ids)


def test_a_mixed_bucket_a_wrong_payload_and_a_bad_range_are_refused_naming_why():
    with pytest.raises(ValueError, match="one dtype"):
        flat_bucket.flatten([("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="load_format null"):
        flat_bucket.unflatten(_named())
    bucket = flat_bucket.flatten(_named())
    bucket["metadata"][2].end_idx += 1
    with pytest.raises(ValueError, match="outside the flat tensor"):
        flat_bucket.unflatten(bucket)
    bucket["metadata"][2].end_idx -= 2
    with pytest.raises(ValueError, match=r"bias: 6 elements in its range, its shape \[7\] needs 7"):
        flat_bucket.unflatten(bucket)


def test_what_sglang_would_refuse_is_refused_in_strict_mode_naming_why():
    """SGLang reads the metadata by attribute (a dict entry is an AttributeError there) and unpickles with an
    allowlist of modules (a class of ours is "Blocked unsafe class loading" there)."""
    named = _named()
    as_dicts = {"flattened_tensor": torch.cat([t.reshape(-1) for _, t in named]),
                "metadata": [vars(m) for m in flat_bucket.flatten(named)["metadata"]]}
    assert [n for n, _ in flat_bucket.unflatten(as_dicts)] == [n for n, _ in named]  # kora's own engine reads both
    with pytest.raises(ValueError, match="need the attributes name, shape, dtype"):
        flat_bucket.unflatten(as_dicts, attrs_only=True)
    payload = serialize_payload({"flattened_tensor": torch.zeros(2), "metadata": [_Ours()]})
    with pytest.raises(ValueError, match=r"_Ours, which SGLang's SafeUnpickler refuses"):
        deserialize_payload(payload, strict=True)


@dataclass
class _Ours:
    name: str = "x"
