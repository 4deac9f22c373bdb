"""kora's fast weight-sync routes on the reference engine: `sync/fast/plan.py`'s receivers behind two HTTP calls.

SGLang has no such routes: a trainer whose plan call gets 404 keeps the HTTP path. The trainer's side is
`sync/fast/distributed.py`.

- `POST /kora/fast_sync/plan` {group_name, mode: "Merge" | "Adapter", metadata: [one `protocol.Bucket.metadata()`
  per bucket, byte_ranges included], slots, lora_name, config_dict}: once per trainer, after its first (HTTP)
  push. Merge: a `fast_receive.PipelinedReceiver` whose buckets land straight in the engine's parameters (names, dtypes,
  shapes checked here). Adapter: a `fast_receive.AdapterRing` of `slots` buffers whose views are made once, checked like
  an adapter load (names and shapes against the model, rank, config), refused where a ring cannot serve the
  adapter (tensors of another dtype than the engine's, pairs on bare parameters such as MoE experts). No
  collective runs: a refusal leaves the weight-update group as it was. Answers {success, buckets, bytes}.
- `POST /kora/fast_sync/push` {group_name, weight_version, verify}: per sync, while the trainer broadcasts the
  plan's buckets over the weight-update group (initialised before, by `/init_weights_update_group`). Merge:
  received as one weight write (`EngineModel.writing`: generation in flight gives way at its next step and
  recomputes its KV cache after) straight into the parameters; then the server's weight version is set.
  Adapter: received into the next ring slot, whose views are registered as `lora_name` with the version:
  served from the next request on; requests already admitted keep their adapter object, whose slot is
  rewritten only `slots` pushes later. The answer comes after the apply has finished on the device. `verify`:
  it also carries the `checksum` of what was applied (`protocol.checksum`, the HTTP routes' definition: every
  tensor completed, in push order).

Both run on the server's weight-sync thread, in order with every other operation on the group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from kora_engine.lm.lora_adapters import LoRAAdapter, build_adapter
from kora_trainer.wire.fast_receive import AdapterRing, PipelinedReceiver
from kora_trainer.wire.group import DEFAULT_GROUP_NAME, WeightUpdateGroup
from kora_trainer.wire.protocol import PackedChecksum, checksum, dtype_name, dtype_of

log = logging.getLogger("kora.hf_engine")

PLAN_ROUTE, PUSH_ROUTE = "/kora/fast_sync/plan", "/kora/fast_sync/push"
Metadata = Sequence[Mapping[str, list[Any]]]


def completed_names(metadata: Metadata) -> list[str]:
    """The tensors of a push in the order their last byte arrives (a split tensor counts where it completes)."""
    names = []
    for m in metadata:
        for name, dtype, shape, (_, end) in zip(m["names"], m["dtypes"], m["shapes"], m["byte_ranges"], strict=True):
            n = dtype_of(dtype).itemsize
            for d in shape:
                n *= int(d)
            if int(end) == n:
                names.append(name)
    return names


def layout(metadata: Metadata) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of every tensor of whole-tensor buckets, in order."""
    return [(n, dtype_of(d), [int(x) for x in s]) for m in metadata
            for n, d, s in zip(m["names"], m["dtypes"], m["shapes"], strict=True)]


def ring_scaling(engine: Any, tensors: Sequence[tuple[str, torch.dtype, list[int]]], lora_name: str,
                 config: dict[str, Any]) -> dict[str, float]:
    """The checks of an adapter load, once, on zeros (names and shapes against the model, rank, config) for an
    adapter served from `AdapterRing` slots; refuses what a ring cannot serve (another dtype than the engine's,
    pairs on bare parameters such as MoE experts). Returns each module's scaling."""
    other = sorted({dtype_name(d) for _, d, _ in tensors if d != engine.dtype})
    if other:
        raise ValueError(f"the adapter comes as {other}, the engine runs {dtype_name(engine.dtype)} (the HTTP "
                         "path converts it)")
    probe = build_adapter(lora_name, "__distributed__", config, [(n, torch.zeros(s, dtype=d)) for n, d, s in tensors],
                          engine.model, engine.dtype, torch.device("cpu"), engine.max_lora_rank)
    if probe.params:
        raise ValueError(f"pairs on bare parameters ({', '.join(sorted(probe.params)[:2])}, ...) are served "
                         "through the HTTP path")
    return {m: w[2] for m, w in probe.weights.items()}


async def json_call(server: Any, request: web.Request, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> web.Response:
    """A kora sync route: the JSON object body to `fn` on the server's weight-sync thread (in order with every
    other operation on the weights); a refusal is a 400 with the message (the trainer reads it and keeps the
    HTTP path), never a 500."""
    try:
        body = await server._json_body(request)  # a body over --max-body-bytes raises aiohttp's 413
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        out = await server._run(fn, body, sync=True)
    except web.HTTPException:
        raise
    except Exception as e:
        log.warning("%s failed: %s", request.path, e)
        return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
    return web.json_response({"success": True, **out})


@dataclass
class _Plan:
    mode: str
    group: WeightUpdateGroup
    receiver: PipelinedReceiver | None = None  # Merge
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # Merge: what a push completes, in order
    ring: AdapterRing | None = None  # Adapter
    packed: PackedChecksum | None = None
    lora_name: str = ""
    config: dict[str, Any] = field(default_factory=dict)


def _finish(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FastSyncRoutes:
    """The two routes of one `HFEngineServer` (`server.engine`, `.receiver`, `.adapters`, `._run`)."""

    def __init__(self, server: Any):
        self.server = server
        self.plans: dict[str, _Plan] = {}

    def routes(self) -> list[tuple[str, str, Any]]:
        return [("POST", PLAN_ROUTE, self.plan), ("POST", PUSH_ROUTE, self.push)]

    async def plan(self, request: web.Request) -> web.Response:
        return await json_call(self.server, request, self._plan)

    async def push(self, request: web.Request) -> web.Response:
        return await json_call(self.server, request, self._push)

    def _plan(self, b: dict[str, Any]) -> dict[str, Any]:
        name = str(b.get("group_name") or DEFAULT_GROUP_NAME)
        group = self.server.receiver.group(name)
        engine = self.server.engine
        metadata = b["metadata"]
        if group.device.type != engine.device.type:
            raise ValueError(f"group {name} runs on {group.device.type}, the engine on {engine.device.type}")
        slots = int(b.get("slots") or 2)
        if b["mode"] == "Merge":
            params = dict(engine.model.named_parameters(remove_duplicate=False))
            plan = _Plan("Merge", group, PipelinedReceiver(metadata, params, group, slots), params,
                         completed_names(metadata))
        elif b["mode"] == "Adapter":
            plan = self._adapter_plan(group, metadata, str(b["lora_name"]), dict(b["config_dict"]), slots)
        else:
            raise ValueError(f"mode {b['mode']!r}: the fast path takes Merge or Adapter")
        self.plans[name] = plan
        sizes = [sum(int(e) - int(s) for s, e in m["byte_ranges"]) for m in metadata]
        return {"buckets": len(sizes), "bytes": sum(sizes)}

    def _adapter_plan(self, group: WeightUpdateGroup, metadata: Metadata, lora_name: str, config: dict[str, Any],
                      slots: int) -> _Plan:
        tensors = layout(metadata)
        ring = AdapterRing(metadata, group.device, ring_scaling(self.server.engine, tensors, lora_name, config), slots)
        return _Plan("Adapter", group, ring=ring, packed=PackedChecksum(tensors, group.device), lora_name=lora_name,
                     config=config)

    def _push(self, b: dict[str, Any]) -> dict[str, Any]:
        name = str(b.get("group_name") or DEFAULT_GROUP_NAME)
        plan = self.plans.get(name)
        if plan is None:
            raise ValueError(f"no fast-sync plan for group {name}: POST {PLAN_ROUTE} first")
        if self.server.receiver.groups.get(name) is not plan.group:
            del self.plans[name]
            raise ValueError(f"group {name} was made again since the plan: POST {PLAN_ROUTE} again")
        version = None if b.get("weight_version") is None else str(b["weight_version"])
        verify = bool(b.get("verify"))
        engine = self.server.engine
        if plan.receiver is not None:
            with engine.writing():  # generation in flight pauses at its next step, then recomputes its cache
                plan.receiver.receive()
                _finish(plan.group.device)
                engine.weights_replaced(plan.names)
                if version is not None:
                    engine.weight_version = version
                sums = checksum((n, plan.params[n]) for n in plan.names) if verify else None
            return {"weight_version": engine.weight_version, "checksum": sums}
        ring, packed = plan.ring, plan.packed
        assert ring is not None and packed is not None
        weights = ring.receive(plan.group)
        _finish(plan.group.device)
        self.server.adapters.upsert_built(LoRAAdapter(plan.lora_name, "__distributed__", ring.rank, weights,
                                                      dict(plan.config), version))
        return {"weight_version": version, "checksum": packed(ring.buffers[ring.last]) if verify else None}
