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
127.0.0.1 and these routes are admin routes, as in SGLang). SGLang unpickles them with an allowlist of modules
(0.5.17 `srt/utils/common.py` `SafeUnpickler`); a strict build's reference engine does the same
(`strict=True` below), so a payload naming a class SGLang refuses (one of kora's) fails on CPU too.
"""

from __future__ import annotations

import base64
import io
import pickle
import threading
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # registers the tensor reducers with ForkingPickler

NamedTensors = list[tuple[str, torch.Tensor]]

_strategy_lock = threading.Lock()


# SGLang 0.5.17's SafeUnpickler.ALLOWED_MODULE_PREFIXES (utils/common.py:2798), less its own modules and
# torch_npu; a class outside them is refused there ("Blocked unsafe class loading")
SGLANG_UNPICKLE_PREFIXES = ("builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.",
                            "weakref.", "torch.", "multiprocessing.resource_sharer.", "multiprocessing.reduction.",
                            "pickletools.", "peft.", "transformers.", "huggingface_hub.")


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not (module + ".").startswith(SGLANG_UNPICKLE_PREFIXES):
            raise ValueError(f"the payload names {module}.{name}, which SGLang's SafeUnpickler refuses: send only "
                             "builtins, types and torch objects")
        return super().find_class(module, name)


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """`[(name, tensor)]` -> one base64 string (what SGLang's serializer emits with output_str=True)."""
    return serialize_payload([(name, t.detach()) for name, t in named])


def deserialize_named_tensors(data: str | bytes, strict: bool = False) -> NamedTensors:
    """The inverse. Accepts the base64 text (or its raw bytes); tensors alias the sender's memory."""
    return _pairs(deserialize_payload(data, strict))


def _pairs(obj: Any) -> NamedTensors:
    if not isinstance(obj, list) or not all(isinstance(e, tuple | list) and len(e) == 2 for e in obj):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return [(str(name), tensor) for name, tensor in obj]


def serialize_tensor_dict(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """`{name: tensor}` -> one base64 string: what SGLang's `/load_lora_adapter_from_tensors` unpickles (0.5.17's
    tp_worker hands the object to the LoRA manager as `Dict[str, Tensor]` and iterates `.items()`; the weight routes
    take the list of pairs above). Found on a real SGLang: a list there is a 400, "'list' object has no attribute
    'items'"."""
    return serialize_payload({name: t.detach() for name, t in named})


def deserialize_adapter_tensors(data: str | bytes, pairs_ok: bool = True) -> NamedTensors:
    """The LoRA route's payload: the dict SGLang takes, or (`pairs_ok`, kora's reference engine outside a build's
    strict mode) a list of pairs. ValueError names the shape wanted."""
    obj = deserialize_payload(data, strict=not pairs_ok)
    if isinstance(obj, dict) and all(isinstance(t, torch.Tensor) for t in obj.values()):
        return [(str(name), tensor) for name, tensor in obj.items()]
    if pairs_ok and isinstance(obj, list):
        return _pairs(obj)
    raise ValueError("/load_lora_adapter_from_tensors takes serialized_named_tensors holding a dict {name: tensor} "
                     f"(SGLang's LoRA manager iterates its items), got {type(obj).__name__}")


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


def deserialize_payload(data: str | bytes, strict: bool = False) -> Any:
    """`strict`: only the modules SGLang's unpickler allows (a build's strict engine)."""
    raw = data.encode("ascii") if isinstance(data, str) else data
    if not _looks_like_pickle(raw):
        raw = base64.b64decode(raw, validate=True)
    if strict:
        return _AllowlistUnpickler(io.BytesIO(raw)).load()
    return ForkingPickler.loads(raw)


def _looks_like_pickle(raw: bytes) -> bool:
    return raw[:1] == b"\x80"  # pickle protocol >= 2 starts with PROTO
