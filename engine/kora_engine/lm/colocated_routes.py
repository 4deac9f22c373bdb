"""kora's colocated fast-sync routes on the reference engine: the trainer on the same device writes the policy
straight into the engine's memory, which it mapped once. The trainer's side is `sync/fast/colocated.py`.

SGLang has no such routes: a trainer whose plan call gets 404 keeps the HTTP path (`/update_weights_from_tensor`,
`/load_lora_adapter_from_tensors`).

- `POST /kora/colocated/plan` {mode: "Merge" | "Adapter" | "EngineMerge", metadata, slots, lora_name,
  config_dict, lease_s, names}: once per trainer, after its first (HTTP) push. Answers {payload, bytes, wake}:
  `payload` is `serialize.serialize_payload` of
  the memory the trainer writes — CUDA IPC handles on GPU, shared-memory segments on CPU (the engine's tensors
  move into shared memory in place; every view of them stays valid). Merge: every named parameter (HF names, the
  engine's own tensors), each group of `fuse` (e.g. one layer's q, k, v: what megatron holds as one fused
  weight) first re-homed into one buffer, rows back to back (`fast_receive.fuse_rows`, SGLang's fused
  qkv_proj layout; values kept), so the trainer folds a fused weight straight into it. Adapter: the buffers of
  an `AdapterRing` of `slots` slots laid out as `metadata` says (`AdapterPack.metadata`), checked like an
  adapter load (`fast_routes.ring_scaling`), and the doorbell word.
- Adapter, per push: the trainer packs the adapter into slot k (k cycling in order), synchronises, then rings
  the doorbell: one 8-byte store of (version << 8 | k) into a shared CPU word the plan handed over with the
  ring. Before every adapter lookup (a request's admission, GET /kora/state) the engine reads the word; a new
  value makes the slot's views the adapter `lora_name` at that version (`publish_rung`), served from that
  request on. No HTTP call per push. A request already admitted keeps its adapter object, whose slot is
  rewritten only `slots` pushes later. No lock: nothing the engine reads is written. `POST
  /kora/colocated/push` {slot, weight_version, verify} publishes the rung slot at once (it must be the one
  the doorbell names) and, with verify, answers its checksum; the trainer calls it on verified pushes.
- Merge and EngineMerge, per push: no HTTP call. The plan's payload also holds `handshake`, the int64 words of
  wire/colocated_words.py in shared CPU memory, and the answer names a `wake` FIFO; a watcher thread
  (colocated_watcher.py) serves each request the trainer stores there. Merge: request n takes the weight lock
  (`EngineModel.begin_write`: generation in flight gives way at its next step and recomputes its KV cache after)
  and answers GRANT n; the trainer writes the merged weights in place, synchronises and stores DONE n; the
  engine marks the written names replaced (the new pristine base: the plan body's `names` {full, adapted}), sets
  the version, gives the lock back and answers ACK n. A trainer that does not come back within the plan's
  `lease_s` loses the lock: the weights are taken as torn (`weight_version` says so) and the push is refused
  (ACK -n). EngineMerge: request n (ARG: version, slot) folds the slot into the pristine base (the HTTP
  lora_merge's fold, one weight write, `EngineModel.planned_merge`), synchronised, the version set under the lock;
  then ACK n. The plan body carries `lora_alpha`, `lora_rank`, `merge_fp32`. With `gather`, an ARM ahead of request
  n (the trainer's step is done) lets the watcher prepare it (`arm_slot`): when no generation holds the weights
  it takes the weight lock for the request and, on a GPU (word_gate.py), enqueues the slot's gather and fold
  behind a kernel that waits for GATE >= n, which the trainer's push stores — the request then only waits for
  them; without the gate it warms the slot's launch path.
- `POST /kora/colocated/checksum` {full} (Merge) or {slot}: the checksum of what the engine serves, for the
  trainer's verified pushes.
- The same pushes over HTTP, for a caller without the shared words: Merge `POST /kora/colocated/begin` {lease_s}
  takes the weight lock, `POST /kora/colocated/push` {weight_version, verify, names} marks `names` replaced, sets
  the version and gives the lock back (or the lease runs out: torn, as above), `POST /kora/colocated/abort` gives
  it back at once; EngineMerge `POST /kora/colocated/push` {slot, weight_version, verify} folds slot `slot`.
- `verify`: the answer carries `protocol.checksum` of what the engine now serves (Merge: `names` in order;
  Adapter: the slot's tensors), which the trainer compares with its own reading of the memory it wrote, and
  `checksum_ms`, the time it took (the trainer's push time leaves hashing out, as the HTTP path's does).

The routes run on the server's weight-sync thread, in order with every other operation on the weights; the
watcher's pushes take the same weight lock.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from kora_engine.lm.colocated_gather import SlotGather
from kora_engine.lm.colocated_watcher import (
    TORN_VERSION,
    Armer,
    Folded,
    MergeHandshake,
    Watcher,
    engine_merge_handshake,
)
from kora_engine.lm.fast_routes import json_call, layout, ring_scaling
from kora_engine.lm.lora_adapters import LoRAAdapter
from kora_engine.lm.word_gate import WordGate
from kora_trainer.wire.colocated_words import GATE, Wake, Words, make_words
from kora_trainer.wire.fast_receive import AdapterRing, doorbell_parts, fuse_rows
from kora_trainer.wire.protocol import PackedChecksum, checksum
from kora_trainer.wire.serialize import serialize_payload

log = logging.getLogger("kora.hf_engine")

PREFIX = "/kora/colocated"
PLAN_ROUTE, BEGIN_ROUTE, PUSH_ROUTE, ABORT_ROUTE, CHECKSUM_ROUTE = (
    f"{PREFIX}/{r}" for r in ("plan", "begin", "push", "abort", "checksum"))
DEFAULT_LEASE_S = 60.0


def _no_lap(name: str) -> None:
    """`fold_slot`'s marks when nobody takes them (the HTTP form of a push)."""


def _answer(version: str | None, body: dict[str, Any], digest: Callable[[], str]) -> dict[str, Any]:
    """A push's answer: the version served, and with `verify` the checksum of what is served and its time."""
    t0 = time.perf_counter()
    sums = digest() if body.get("verify") else None
    return {"weight_version": version, "checksum": sums, "checksum_ms": (time.perf_counter() - t0) * 1000}


def _lease_s(body: dict[str, Any]) -> float:
    lease_s = float(body.get("lease_s") or DEFAULT_LEASE_S)
    if not 0 < lease_s <= 3600:
        raise ValueError(f"lease_s {lease_s}: give 0 < lease_s <= 3600 seconds")
    return lease_s


@dataclass
class _Lease:
    """The engine's weight lock, held between a Merge begin and its push."""

    timer: threading.Timer
    expired: bool = False


@dataclass(frozen=True)
class _Armed:
    """A request `arm_slot` took the weight lock for, and whether it enqueued its gather and fold behind GATE >= n
    (`launched`: a GPU gate) or left them to the request (no gate: a CPU engine)."""

    n: int
    slot: int
    launched: bool


@dataclass
class _Plan:
    mode: str
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # Merge
    ring: AdapterRing | None = None  # Adapter
    doorbell: torch.Tensor | None = None  # Adapter: int64 [1] in shared memory, -1 until the first push
    rung: int = -1  # Adapter: the doorbell value last published
    merge: tuple[float, int, bool] | None = None  # EngineMerge: lora_alpha, lora_rank, merge_fp32
    folds: dict[int, Any] = field(default_factory=dict)  # EngineMerge: each slot's planned fold (model.PlannedMerge)
    marks: dict[int, list[torch.cuda.Event]] = field(default_factory=dict)  # ... and the CUDA events timing it
    # EngineMerge with the plan's `gather`: the engine gathers the trainer's adapter into the slot and decides the
    # delta-skip itself (colocated_gather.py)
    gather: SlotGather | None = None
    packed: PackedChecksum | None = None
    lora_name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    names: dict[bool, list[str]] = field(default_factory=dict)  # Merge: full -> what a push writes
    watcher: Watcher | None = None  # Merge, EngineMerge: the shared-memory handshake (colocated_watcher.py)
    words: Words | None = None  # ... its words
    # EngineMerge with `gather` on a GPU (word_gate.py): an armed request's work is enqueued ahead of it
    gate: WordGate | None = None
    armed: _Armed | None = None  # the request whose gather and fold wait behind GATE, the weight lock held for it
    served: int = -1  # the slot holding the pairs last pushed: the delta's reference, never armed


class ColocatedRoutes:
    """The colocated routes of one `HFEngineServer` (`server.engine`, `.adapters`, `._run`)."""

    def __init__(self, server: Any):
        self.server = server
        self.plan: _Plan | None = None
        self.lease: _Lease | None = None
        self._guard = threading.Lock()  # the lease against its timer
        self._publishing = threading.Lock()  # one publication per doorbell value
        server.adapters.before_lookup = self.publish_rung

    def routes(self) -> list[tuple[str, str, Any]]:
        return [("POST", route, self._route(fn)) for route, fn in
                ((PLAN_ROUTE, self._plan), (BEGIN_ROUTE, self._begin), (PUSH_ROUTE, self._push),
                 (ABORT_ROUTE, self._abort), (CHECKSUM_ROUTE, self._checksum))]

    def _route(self, fn: Any) -> Any:
        async def handler(request: web.Request) -> web.Response:
            return await json_call(self.server, request, fn)
        return handler

    # ---- plan -------------------------------------------------------------------------------------------

    def _plan(self, b: dict[str, Any]) -> dict[str, Any]:
        engine = self.server.engine
        if self.lease is not None:
            raise ValueError("a Merge push holds the weights: finish it before planning again")
        lease_s = _lease_s(b)  # Merge: how long a push may hold the weights
        old, self.plan = self.plan, None  # a plan call ends the previous plan, whatever its outcome
        if old is not None and old.watcher is not None:  # and its handshake first
            old.watcher.stop()
        if old is not None and old.gate is not None:
            old.gate.close()
        if b.get("mode") == "Merge":
            params = dict(engine.model.named_parameters(remove_duplicate=False))
            groups = [[str(n) for n in g] for g in b.get("fuse") or []]
            names = {full: [str(n) for n in b.get("names", {}).get(key) or []]
                     for full, key in ((True, "full"), (False, "adapted"))}
            unknown = sorted({n for g in [*groups, *names.values()] for n in g if n not in params})
            if unknown:
                raise ValueError(f"fuse or names name weights the engine does not have: {unknown[:3]}")
            with engine.writing():  # no forward reads a weight while it moves
                fuse_rows(params, [g for g in groups if len(g) > 1])
            plan = _Plan("Merge", params={n: p.detach() for n, p in params.items()}, names=names)
            exported = list(plan.params.items())
        elif b.get("mode") in ("Adapter", "EngineMerge"):
            mode, metadata, name, config = b["mode"], b["metadata"], str(b["lora_name"]), dict(b["config_dict"])
            tensors = layout(metadata)
            ring = AdapterRing(metadata, engine.device, ring_scaling(engine, tensors, name, config),
                               slots=int(b.get("slots") or 3))
            plan = _Plan(mode, ring=ring, packed=PackedChecksum(tensors, engine.device), lora_name=name, config=config)
            exported = [(f"slot{i}", buf) for i, buf in enumerate(ring.buffers)]
            if mode == "Adapter":
                plan.doorbell = torch.full((1,), -1, dtype=torch.int64)  # CPU memory shared with the trainer
                exported.append(("doorbell", plan.doorbell))
            else:  # the fold's parameters, checked once
                plan.merge = (float(b["lora_alpha"]), int(b["lora_rank"]), bool(b.get("merge_fp32", True)))
                if b.get("gather"):
                    plan.gather = SlotGather(dict(b["gather"]), ring, engine.device)
                    self._plan_folds(plan)
        else:
            raise ValueError(f"mode {b.get('mode')!r}: the colocated fast path takes Merge, Adapter or EngineMerge")
        answer: dict[str, Any] = {"bytes": sum(t.numel() * t.element_size() for _, t in exported),
                                  "gathers": plan.gather is not None}
        if plan.mode != "Adapter":  # the per-push handshake in shared memory (wire/colocated_words.py)
            words, wake = make_words(), Wake()
            exported.append(("handshake", words))
            answer["wake"] = wake.path
        answer["payload"] = serialize_payload(exported)  # CPU: the tensors move into shared memory, in place
        if plan.mode != "Adapter":
            plan.watcher = self._watch(plan, Words(words), wake, lease_s)
        self.plan = plan
        return answer

    def _watch(self, plan: _Plan, words: Words, wake: Wake, lease_s: float) -> Watcher:
        watcher: Watcher | None = None
        handle: Callable[[int], int]  # the answer for ACK
        if plan.mode == "Merge":
            handle = MergeHandshake(self.server.engine, words, wake, plan.names, lease_s,
                                    lambda: watcher is not None and watcher.stopping)
        else:
            handle = engine_merge_handshake(words, self.fold_slot)
        plan.words = words
        armer = None
        if plan.gather is not None:  # EngineMerge: an armed watcher prelaunches or warms the coming slot's push
            plan.gate = WordGate.open(words.tensor, self.server.engine.device)
            # bound to this plan: a new plan call stops this watcher (which disarms) after `self.plan` has moved on
            armer = Armer(functools.partial(self.arm_slot, plan), functools.partial(self.disarm, plan))
        watcher = Watcher(words, wake, handle, self.server.engine.device, armer=armer)
        return watcher

    def _planned(self, mode: str) -> _Plan:
        if self.plan is None or self.plan.mode != mode:
            raise ValueError(f"no colocated {mode} plan: POST {PLAN_ROUTE} first")
        return self.plan

    # ---- Merge: begin, push, abort ----------------------------------------------------------------------

    def _begin(self, b: dict[str, Any]) -> dict[str, Any]:
        self._planned("Merge")
        if self.lease is not None:
            raise ValueError(f"a Merge push already holds the weights: POST {PUSH_ROUTE} or {ABORT_ROUTE}")
        lease_s = _lease_s(b)
        self.server.engine.begin_write()  # generation in flight gives way at its next step
        lease = _Lease(threading.Timer(lease_s, self._expire))
        lease.timer.daemon = True
        with self._guard:
            self.lease = lease
        lease.timer.start()
        return {}

    def _release(self) -> _Lease | None:
        with self._guard:
            lease, self.lease = self.lease, None
        if lease is not None:
            lease.timer.cancel()
            if not lease.expired:
                self.server.engine.end_write()
        return lease

    def _expire(self) -> None:
        with self._guard:
            lease = self.lease
            if lease is None:
                return
            lease.expired = True
        log.error("the colocated Merge writer did not push within its lease: the weights may be torn")
        self.server.engine.weight_version = TORN_VERSION
        self.server.engine.end_write()

    def _push(self, b: dict[str, Any]) -> dict[str, Any]:
        if self.plan is not None and self.plan.mode == "Adapter":
            return self._adapter_push(b)
        if self.plan is not None and self.plan.mode == "EngineMerge":
            return self._engine_merge_push(b)
        plan = self._planned("Merge")
        engine = self.server.engine
        version = None if b.get("weight_version") is None else str(b["weight_version"])
        names = [str(n) for n in b.get("names") or []]
        unknown = [n for n in names if n not in plan.params]
        lease = self.lease
        if lease is None:
            raise ValueError(f"no Merge push in progress: POST {BEGIN_ROUTE} first")
        try:
            if lease.expired:
                raise ValueError("the push came after its lease ran out: the weights were taken as torn")
            if unknown:
                raise ValueError(f"names the engine does not have: {unknown[:3]}")
            engine.weights_replaced(names)  # the trainer synchronised its writes before this call
            if version is not None:
                engine.weight_version = version
            return _answer(engine.weight_version, b, lambda: checksum((n, plan.params[n]) for n in names))
        finally:
            self._release()

    def _abort(self, b: dict[str, Any]) -> dict[str, Any]:
        lease = self._release()
        return {"released": lease is not None}

    # ---- Adapter ----------------------------------------------------------------------------------------

    def publish_rung(self) -> None:
        """Serve the slot the doorbell names, if it changed since the last publication (every adapter lookup)."""
        plan = self.plan
        if plan is None or plan.doorbell is None:
            return
        value = int(plan.doorbell[0])  # one aligned 8-byte load, as the trainer's one 8-byte store
        if value == plan.rung or value < 0:
            return
        with self._publishing:
            if value == plan.rung:
                return
            ring = plan.ring
            assert ring is not None
            version, slot = doorbell_parts(value)
            ring.last = slot
            self.server.adapters.upsert_built(LoRAAdapter(plan.lora_name, "__colocated__", ring.rank,
                                                          ring.weights[slot], dict(plan.config), str(version)))
            plan.rung = value

    def _adapter_push(self, b: dict[str, Any]) -> dict[str, Any]:
        plan = self._planned("Adapter")
        ring, packed = plan.ring, plan.packed
        assert ring is not None and packed is not None
        slot = int(b["slot"])
        self.publish_rung()
        version, rung = doorbell_parts(plan.rung)
        if plan.rung < 0 or slot != rung:
            raise ValueError(f"slot {slot} is not the one the doorbell names ({plan.rung}): ring it first")
        return _answer(str(version), b, lambda: packed(ring.buffers[slot]))

    # ---- EngineMerge ------------------------------------------------------------------------------------

    def _engine_merge_push(self, b: dict[str, Any]) -> dict[str, Any]:
        """HTTP form of an EngineMerge push (the trainer's uses the handshake): slot `slot` folded, version set."""
        slot = int(b["slot"])
        self.fold_slot(slot, None if b.get("weight_version") is None else str(b["weight_version"]))
        return self._checksum({**b, "slot": slot})

    def fold_slot(self, slot: int, version: str | None, lap: Callable[[str], None] | None = None,
                  threshold: float | None = None, request: int = 0) -> Folded:
        """The pairs in ring slot `slot` folded into the pristine base (the HTTP lora_merge's fold, as one weight
        write) and the version set, both under the weight lock: a generation admitted after it sees the new weights
        and reports the new version. `lap("locking")`, `lap("locked")`, `lap("gathered")`, `lap("launched")` and
        `lap("synced")` mark the lock asked for and held, the gather and the fold enqueued, and the fold done (the
        handshake's words). Returns the fold's device time (ms, CUDA events; None off a GPU), so the push's report
        tells the fold from the waking, locking and synchronising around it.

        With the plan's `gather` the engine first gathers the trainer's adapter into the slot, with its delta
        number against the slot before (colocated_gather.py), in the same stream ahead of the fold; when that
        number is not above `threshold` (the delta-skip; None: the push stands) the previous slot, which holds
        the pairs last pushed, is folded again, so the weights come back bit for bit before the lock is given
        back, and the version stays.

        `request` n that `arm_slot` prelaunched finds the lock held and its gather and fold enqueued behind the
        GATE its trainer stored: only their end is on its path (a slot other than the armed one is folded over
        them, the same as an unarmed push)."""
        plan = self._planned("EngineMerge")
        ring = plan.ring
        assert ring is not None
        if not 0 <= slot < len(ring.buffers):
            raise ValueError(f"slot {slot}: the ring has slots 0..{len(ring.buffers) - 1}")
        engine = self.server.engine
        mark = lap or _no_lap
        armed = plan.armed
        if armed is not None and request and armed.n == request:
            plan.armed = None
            mark("locking")
            mark("locked")  # held since the arm
            try:
                self._open(plan, request)  # the trainer stored GATE before REQ: a no-op unless it did not
                prelaunched = armed.launched and armed.slot == slot
                if prelaunched:  # enqueued at the arm, off this push's path
                    mark("gathered")
                else:
                    self._launch(plan, slot, mark)
                mark("launched")
                return self._settle(plan, slot, version, threshold, mark)._replace(prelaunched=prelaunched)
            finally:
                engine.end_write()
        mark("locking")
        with engine.writing():
            mark("locked")
            self._launch(plan, slot, mark)
            mark("launched")
            return self._settle(plan, slot, version, threshold, mark)

    def _launch(self, plan: _Plan, slot: int, mark: Callable[[str], None] = _no_lap) -> None:
        """Slot `slot`'s gather (with `gather`) and fold enqueued, between the slot's timing events (made once: a
        push's host time is on its critical path). Under the weight lock."""
        fold = self._slot_fold(plan, slot)
        cuda = self.server.engine.device.type == "cuda"
        if cuda and slot not in plan.marks:
            plan.marks[slot] = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        marks = plan.marks.get(slot, [])
        if cuda:
            marks[0].record()
        if plan.gather is not None:
            plan.gather.enqueue(slot)
            mark("gathered")
        fold.run()
        if cuda:
            marks[1].record()

    def _settle(self, plan: _Plan, slot: int, version: str | None, threshold: float | None,
                mark: Callable[[str], None]) -> Folded:
        """The launched fold of `slot` done on the device, the delta-skip decided (the slot before folded back in
        when the number is not above `threshold`) and the version set. Under the weight lock."""
        engine, ring = self.server.engine, plan.ring
        assert ring is not None
        cuda = engine.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(engine.device)  # whole before the version names it (and the number read)
        delta = plan.gather.delta() if plan.gather is not None else None
        keep = threshold is None or delta is None or delta > threshold
        if not keep:
            self._slot_fold(plan, (slot - 1) % len(ring.buffers)).run()  # the last pushed pairs again
            if cuda:
                torch.cuda.synchronize(engine.device)
        elif version is not None:
            plan.served = slot
        mark("synced")
        if keep and version is not None:
            engine.weight_version = version
        marks = plan.marks.get(slot, [])
        return Folded(marks[0].elapsed_time(marks[1]) if cuda else None, keep, delta)

    # ---- EngineMerge's arm: the watcher's, ahead of a request (wire/colocated_words.py ARM) -------------------

    def arm_slot(self, plan: _Plan, n: int, slot: int) -> None:
        """Request n will fold `slot`: when no generation or write holds the weights, take the weight lock for it
        (`fold_slot(..., request=n)` or `disarm(n)` gives it back) and, with a GPU gate on the words, enqueue the
        slot's gather and fold behind GATE >= n (word_gate.py), so the trainer's store of GATE starts them.
        Otherwise warm the launch path on the slot (`SlotGather.warm`: the slot is scratch until the
        request gathers it again). A generation admitted while armed waits for the push (at most ARM_S)."""
        gather, ring, engine = plan.gather, plan.ring, self.server.engine
        assert gather is not None and ring is not None
        if not 0 <= slot < len(ring.buffers):
            raise ValueError(f"ARM_SLOT {slot}: the ring has slots 0..{len(ring.buffers) - 1}")
        if slot == plan.served:  # its pairs are what the next push's delta is taken against: not scratch
            log.warning("colocated EngineMerge: ARM_SLOT %d holds the pairs last pushed; push %d is not armed", slot, n)
            return
        if plan.armed is not None or not engine.try_begin_write():
            gather.warm(slot)
            return
        try:
            if plan.gate is not None:
                plan.gate.hold(GATE, n)
                self._launch(plan, slot)
            else:
                gather.warm(slot)
        except BaseException:
            self._open(plan, n)  # a kernel held behind the gate goes
            engine.end_write()
            raise
        plan.armed = _Armed(n, slot, launched=plan.gate is not None)

    def disarm(self, plan: _Plan, n: int) -> None:
        """Armed request n is not coming (ARM_S passed, or the watcher stops), or was served: if it is still armed,
        open the gate, let its enqueued work run and fold the slot before back in (the delta-skip's path: the
        weights are the last push's again, the version unchanged), and give the lock back."""
        armed = plan.armed
        if armed is None or armed.n != n:
            return
        plan.armed = None
        try:
            if armed.launched:
                self._open(plan, n)
                self._settle(plan, armed.slot, None, float("inf"), _no_lap)
        finally:
            self.server.engine.end_write()

    @staticmethod
    def _open(plan: _Plan, n: int) -> None:
        if plan.words is not None:
            plan.words[GATE] = max(n, plan.words[GATE])

    def _plan_folds(self, plan: _Plan) -> None:
        """With `gather`, at plan time: every slot filled with the trainer's adapter (what the engine serves: the
        HTTP push came just before) and every slot's fold planned and run once, under the weight lock (a fold's
        first run compiles and captures it, writing the weights: the same values they hold), so no push plans."""
        engine, ring, gather = self.server.engine, plan.ring, plan.gather
        assert ring is not None and gather is not None
        with engine.writing():
            gather.fill()
            plan.served = len(ring.buffers) - 1  # every slot holds it; the trainer's first request names slot 0
            for k in range(len(ring.buffers)):
                self._slot_fold(plan, k).run()
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)

    def _slot_fold(self, plan: _Plan, slot: int) -> Any:
        """Slot `slot`'s planned fold (model.PlannedMerge), planned once: its pairs stay at their addresses."""
        ring, merge = plan.ring, plan.merge
        assert ring is not None and merge is not None
        fold = plan.folds.get(slot)
        if fold is None or not fold.current():
            alpha, rank, fp32 = merge
            pairs = {m: (a, bb) for m, (a, bb, _) in ring.weights[slot].items()}
            fold = plan.folds[slot] = self.server.engine.planned_merge(pairs, alpha, rank, fp32)
        return fold

    def _checksum(self, b: dict[str, Any]) -> dict[str, Any]:
        """`POST /kora/colocated/checksum` {slot} (Adapter, EngineMerge) or {full} (Merge): what the engine serves
        now, for the trainer's verified pushes (the answer of a push with verify)."""
        plan = self.plan
        if plan is None:
            raise ValueError(f"no colocated plan: POST {PLAN_ROUTE} first")
        engine, verify = self.server.engine, {"verify": True}
        if plan.mode == "Merge":
            names = plan.names[bool(b.get("full"))]
            return _answer(engine.weight_version, verify, lambda: checksum((n, plan.params[n]) for n in names))
        ring, packed = plan.ring, plan.packed
        assert ring is not None and packed is not None
        slot = int(b["slot"])
        if not 0 <= slot < len(ring.buffers):
            raise ValueError(f"slot {slot}: the ring has slots 0..{len(ring.buffers) - 1}")
        return _answer(engine.weight_version, {**verify, **b}, lambda: packed(ring.buffers[slot]))
