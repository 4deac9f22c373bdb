"""Tensors handed to an engine on the same host without copying them through HTTP.

SGLang's `/update_weights_from_tensor` and `/load_lora_adapter_from_tensors` take
`serialized_named_tensors`: one base64 string per tensor-parallel rank, each the
`MultiprocessingSerializer` bytes of a `[(name, tensor), ...]` list — a pickle made with
`torch.multiprocessing`'s ForkingPickler, whose reducers replace a tensor's storage by a handle:

- a CUDA tensor becomes a CUDA IPC handle (the receiver maps the sender's memory);
- a CPU tensor becomes a shared-memory segment. torch's default Linux strategy
  (`file_descriptor`) passes a file descriptor through a socket that only the sender's own
  children may open, so between two unrelated processes (a trainer and an engine server) we
  switch to the `file_system` strategy for the dump: the storage moves into a named segment in
  /dev/shm that any process of the same user can map.

Either way the bytes never leave the host and the payload is metadata only. The sender must keep
its tensors alive until the receiver has read them — i.e. until the HTTP call returns — or the
segment / IPC handle is gone when the engine opens it.

The receiving side unpickles: only accept these payloads from a trusted trainer (the engine binds
127.0.0.1 and these routes are admin routes, as in SGLang).
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # registers the tensor reducers with ForkingPickler

NamedTensors = list[tuple[str, torch.Tensor]]

_strategy_lock = threading.Lock()


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """`[(name, tensor)]` -> one base64 string (what SGLang's serializer emits with output_str=True)."""
    return serialize_payload([(name, t.detach()) for name, t in named])


def deserialize_named_tensors(data: str | bytes) -> NamedTensors:
    """The inverse. Accepts the base64 text (or its raw bytes); tensors alias the sender's memory."""
    obj = deserialize_payload(data)
    if not isinstance(obj, list) or not all(isinstance(e, tuple | list) and len(e) == 2 for e in obj):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return [(str(name), tensor) for name, tensor in obj]


def serialize_payload(payload: Any) -> str:
    """Any picklable object holding tensors (e.g. SGLang's flattened-bucket dict) -> base64 text."""
    buf = io.BytesIO()
    with _strategy_lock:
        previous = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")
        try:
            ForkingPickler(buf).dump(payload)
        finally:
            mp.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_payload(data: str | bytes) -> Any:
    raw = data.encode("ascii") if isinstance(data, str) else data
    if not _looks_like_pickle(raw):
        raw = base64.b64decode(raw, validate=True)
    return ForkingPickler.loads(raw)


def _looks_like_pickle(raw: bytes) -> bool:
    return raw[:1] == b"\x80"  # pickle protocol >= 2 starts with PROTO
