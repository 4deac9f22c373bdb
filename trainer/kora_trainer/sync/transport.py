"""How bucket bytes reach the engines.

- `DistributedTransport`: the trainer is rank 0 of a weight-update group the engines joined (gloo on
  CPU, NCCL on GPU). Per bucket, every engine gets one metadata-only HTTP call — issued from the
  client's thread, because the engine answers only after it has received the bytes — while rank 0
  broadcasts the bucket as ONE flat uint8 tensor (`load_format: "flattened_bucket"`).
- `ColocatedTransport`: engines on the same host; the tensors are handed over in memory
  (`/update_weights_from_tensor`, `/load_lora_adapter_from_tensors` with `serialize.py`'s payloads:
  shared memory on CPU, CUDA IPC on GPU). The bytes never cross a socket; HTTP carries handles.

Both check each engine's answer: the engine reports the checksum of what it applied and the sender
compares it with its own (a wrong or torn push fails the sync instead of silently serving garbage).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from kora_trainer.wire import flat_bucket
from kora_trainer.wire.engine_client import EngineClient, EngineError
from kora_trainer.wire.group import WeightUpdateGroup, init_weight_update_group
from kora_trainer.wire.ports import free_port
from kora_trainer.wire.protocol import FLAT, Bucket, dtype_name, pack
from kora_trainer.wire.serialize import serialize_named_tensors, serialize_payload, serialize_tensor_dict

GROUP_NAME = "weight_update_group"
T = TypeVar("T")


class SyncError(RuntimeError):
    """A push that did not land on every engine as sent."""


def wait_all(futures: Sequence[Future[Any]], timeout_s: float) -> list[Any]:
    """Every engine's answer; the first failure (after all have finished or timed out) is raised."""
    results, errors = [], []
    for f in futures:
        try:
            results.append(f.result(timeout=timeout_s))
        except (EngineError, TimeoutError) as e:
            errors.append(e)
    if errors:
        raise SyncError(f"{len(errors)} of {len(futures)} engines failed: {errors[0]}") from errors[0]
    return results


class DistributedTransport:
    kind = "distributed"

    def __init__(self, clients: Sequence[EngineClient], group: WeightUpdateGroup, timeout_s: float = 300.0):
        self.clients, self.group, self.timeout_s = list(clients), group, timeout_s

    @classmethod
    def connect(cls, clients: Sequence[EngineClient], backend: str = "gloo", host: str = "127.0.0.1",
                timeout_s: float = 120.0) -> DistributedTransport:
        """Create the group as rank 0; engine i joins as rank 1+i (one rank per engine: tp 1 here)."""
        port = free_port(host)
        world = 1 + len(clients)
        futs = [c.submit(c.init_weights_update_group, host, port, 1 + i, world, GROUP_NAME, backend)
                for i, c in enumerate(clients)]
        try:
            group = init_weight_update_group(host, port, 0, world, GROUP_NAME, backend, timeout_s=timeout_s)
        finally:
            wait_all(futs, timeout_s)  # surfaces an engine's refusal even when our side timed out
        return cls(clients, group, timeout_s)

    def send(self, bucket: Bucket, tensors: dict[str, torch.Tensor],
             call: Callable[[EngineClient, dict[str, list[Any]]], dict[str, Any]]) -> list[dict[str, Any]]:
        """One bucket: HTTP metadata to every engine (threads) + one broadcast from rank 0."""
        meta = bucket.metadata()
        futs = [c.submit(call, c, meta) for c in self.clients]
        self.group.broadcast(pack(bucket, tensors, self.group.device))
        return wait_all(futs, self.timeout_s)

    def send_tensors(self, named: list[tuple[str, torch.Tensor]],
                     call: Callable[[EngineClient, dict[str, list[Any]]], dict[str, Any]]) -> list[dict[str, Any]]:
        """SGLang's per-tensor form (what every build has; kora's flat bucket is the reference engine's): HTTP
        names/dtypes/shapes to every engine, then one broadcast per tensor in that order from rank 0."""
        meta = tensor_metadata(named)
        futs = [c.submit(call, c, meta) for c in self.clients]
        for _, t in named:
            self.group.broadcast(t.detach().to(self.group.device).contiguous())
        return wait_all(futs, self.timeout_s)

    def close(self) -> None:
        for c in self.clients:
            with contextlib.suppress(EngineError):  # an engine already gone has nothing to tear down
                c.destroy_weights_update_group(GROUP_NAME)


def tensor_metadata(named: list[tuple[str, torch.Tensor]]) -> dict[str, list[Any]]:
    """SGLang's names / dtypes (torch attribute names) / shapes of whole tensors."""
    return {"names": [n for n, _ in named], "dtypes": [dtype_name(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}


def packed_views(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Copies of `named` as views into ONE buffer per dtype. The pickler shares a storage once, so a
    bucket becomes one shared-memory segment (or one CUDA IPC handle) instead of one per tensor —
    on CPU that is ~1 ms instead of ~5 ms per tensor."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: list[tuple[str, torch.Tensor] | None] = [None] * len(named)
    for dtype, idx in by_dtype.items():
        device = named[idx[0]][1].device
        flat = torch.empty(sum(named[i][1].numel() for i in idx), dtype=dtype, device=device)
        offset = 0
        for i in idx:
            name, t = named[i]
            view = flat[offset:offset + t.numel()].view(t.shape)
            view.copy_(t.detach())
            out[i] = (name, view)
            offset += t.numel()
    return [o for o in out if o is not None]


# call(client, payload, load_format): one engine's in-memory route, with the payload ColocatedTransport made
InMemoryCall = Callable[[EngineClient, str, str | None], dict[str, Any]]


class ColocatedTransport:
    kind = "colocated"

    def __init__(self, clients: Sequence[EngineClient], timeout_s: float = 300.0):
        self.clients, self.timeout_s = list(clients), timeout_s

    def send(self, named: list[tuple[str, torch.Tensor]], call: InMemoryCall,
             as_dict: bool = False, flat: bool = False, clock: PhaseClock | None = None) -> list[dict[str, Any]]:
        """Hand `named` to every engine in memory; `call(client, payload, load_format)`. The tensors are copied
        first: serialising moves a CPU tensor's storage into shared memory, which must not happen to a live
        parameter, and the copies stay alive until every engine has answered (they alias them until then).
        `flat` (an engine that reads SGLang's flattened bucket on these routes): tensors of one dtype go as ONE
        tensor plus their metadata (`load_format` "flattened_bucket"), so the pickle carries one CUDA IPC handle and
        one reference count instead of one per tensor; else (or several dtypes) the list or dict of tensors, as
        views of one buffer per dtype. `as_dict`: a {name: tensor} dict (SGLang's LoRA route), not the weight
        routes' list of pairs."""
        t0 = time.perf_counter()
        fmt: str | None = None
        keep: Any
        if flat and len({t.dtype for _, t in named}) == 1:
            keep, fmt = flat_bucket.flatten(named), FLAT
            payload = serialize_payload(keep)
        else:
            keep = packed_views(named)
            payload = serialize_tensor_dict(keep) if as_dict else serialize_named_tensors(keep)
        if clock is not None:
            clock.add("pack_ms", time.perf_counter() - t0)
        futs = [c.submit(call, c, payload, fmt) for c in self.clients]
        try:
            return wait_all(futs, self.timeout_s)
        finally:
            del keep

    def close(self) -> None:
        pass


class PhaseClock:
    """Where an HTTP push's time went (SyncReport.phases), in ms: a phase several engines run at once counts its
    slowest engine (`most`); a phase repeated per bucket adds up (`add`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ms: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.ms[phase] = round(self.ms.get(phase, 0.0) + seconds * 1000, 2)

    def most(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.ms[phase] = round(max(self.ms.get(phase, 0.0), seconds * 1000), 2)

    def timed(self, phase: str, fn: Callable[[], T]) -> T:
        """`fn()` on a client thread, its time the phase's slowest engine's."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.most(phase, time.perf_counter() - t0)
