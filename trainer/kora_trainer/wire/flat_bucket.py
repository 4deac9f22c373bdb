"""SGLang's flattened bucket for `/update_weights_from_tensor` (`load_format: "flattened_bucket"`): one bucket's
tensors as ONE flat tensor plus per-tensor metadata, so a same-host push hands the engine one CUDA IPC handle (or
one shared-memory segment) per call instead of one per tensor — opening a handle costs the receiver far more than
reading the bytes behind it.

The shape matched: sglang `srt/weight_sync/tensor_bucket.py` (`FlattenedTensorBucket`, `FlattenedTensorMetadata`
with name, shape, dtype, start_idx, end_idx, numel; the payload is the dict {"flattened_tensor", "metadata"}).
Two layouts of the flat tensor exist there: the older one holds tensors of one dtype and indexes elements; the
newer (`supports_multi_dtypes`) holds uint8 bytes and indexes bytes. `unflatten` reads both; `flatten` writes the
one-dtype layout (every bucket kora builds this way is of one dtype) and refuses a mix rather than cast.

SGLang's receivers read the metadata by attribute (`meta.start_idx`: weight_updater.py:366 and tp_worker.py:243 in
0.5.17) and unpickle with an allowlist of modules (utils/common.py `SafeUnpickler`: `types.` and `torch.` among
them, kora's modules not), so each entry is a `types.SimpleNamespace`: it unpickles on both sides without
importing SGLang here or kora there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

Named = tuple[str, torch.Tensor]
FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


def flatten(named: Sequence[Named]) -> dict[str, Any]:
    """[(name, tensor), ...] of one dtype and device -> {"flattened_tensor": 1-D copy, "metadata": [entry, ...]}.

    The flat tensor is a new allocation; the sender keeps the returned dict alive until the engine has answered.
    """
    if not named:
        raise ValueError("a flattened bucket needs at least one tensor")
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) > 1:
        raise ValueError(f"a flattened bucket holds one dtype, got {sorted(map(str, dtypes))}: bucket per dtype")
    flat = torch.cat([t.reshape(-1) for _, t in named])  # one copy kernel for the bucket, not one per tensor
    metadata, start = [], 0
    for name, t in named:
        end = start + t.numel()
        metadata.append(SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=end,
                                        numel=t.numel()))
        start = end
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten(bucket: Any, attrs_only: bool = False) -> list[Named]:
    """The payload dict (metadata as dicts or as objects with the fields as attributes) -> views of its flat
    tensor, in order. `attrs_only` (a strict SGLang build): metadata read by attribute only, as SGLang reads it.

    ValueError for a payload of another shape (e.g. a plain named-tensor list sent with this load_format) or a
    tensor whose range lies outside the flat tensor."""
    if not (isinstance(bucket, dict) and isinstance(bucket.get("flattened_tensor"), torch.Tensor)
            and isinstance(bucket.get("metadata"), list)):
        raise ValueError('load_format "flattened_bucket" needs the payload {"flattened_tensor": a 1-D tensor, '
                         f'"metadata": [...]}}, got {type(bucket).__name__}: send load_format null for a list')
    flat = bucket["flattened_tensor"]
    out: list[Named] = []
    for m in bucket["metadata"]:
        if attrs_only and not all(hasattr(m, k) for k in FIELDS):
            raise ValueError(f"flattened_bucket metadata entries need the attributes {', '.join(FIELDS)} (SGLang "
                             f"reads them so), got {type(m).__name__}")
        f: dict[str, Any] = m if isinstance(m, dict) else {k: getattr(m, k) for k in FIELDS if hasattr(m, k)}
        dtype = f["dtype"] if isinstance(f["dtype"], torch.dtype) else getattr(torch, str(f["dtype"]))
        if not 0 <= f["start_idx"] <= f["end_idx"] <= flat.numel():
            raise ValueError(f"{f['name']}: range [{f['start_idx']}, {f['end_idx']}) is outside the flat tensor "
                             f"of {flat.numel()} elements")
        piece = flat[f["start_idx"]:f["end_idx"]]
        if flat.dtype == torch.uint8 and dtype != torch.uint8:  # the multi-dtype layout: byte offsets
            size = torch.empty((), dtype=dtype).element_size()
            if piece.storage_offset() % size or piece.numel() % size:  # an unaligned range: view a copy of it
                piece = piece.clone()
            if piece.numel() % size:
                raise ValueError(f"{f['name']}: {piece.numel()} bytes is no whole number of {dtype} elements")
            piece = piece.view(dtype)
        elif piece.dtype != dtype:  # an older one-dtype bucket of another dtype than the tensor's: SGLang casts
            piece = piece.to(dtype)
        shape = tuple(int(d) for d in f["shape"])
        if piece.numel() != math.prod(shape):
            raise ValueError(f"{f['name']}: {piece.numel()} elements in its range, its shape {list(shape)} needs "
                             f"{math.prod(shape)}")
        out.append((str(f["name"]), piece.reshape(shape)))
    return out
