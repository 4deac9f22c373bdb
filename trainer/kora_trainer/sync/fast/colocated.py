"""The fast path of weight sync for colocated engines: the trainer writes each push straight into the memory of
the engines beside it, mapped once (CUDA IPC on GPU, shared memory on CPU). The engine's side is
kora's reference engine's colocated routes (only that engine answers them); `path.with_fast_path` picks this
sender for a `ColocatedTransport`.

The steps are base.py's `FastSender`'s, the same for every mode; what a mode does in them is its strategy
object's (colocated_modes.py): the first sync is the HTTP path's (checked by the engines' checksums), then
one plan, then every later push on the fast path (delta-skip by `FlatDelta`, collective over the trainer's
group), with the HTTP path kept — and the reason printed — wherever the plan cannot cover the policy or an
engine has no route (404: SGLang).

No HTTP call per push in the steady state, in any mode (verified pushes add one per engine, for its checksum):

- Adapter: the engine makes a ring of `adapter_slots` flat buffers laid out as `AdapterPack.metadata` says, and a
  doorbell word in shared memory, and hands them over; a push is one gather (`AdapterPack.pack_into`) into slot
  k (cycling in order), a synchronise, and one 8-byte store of (version, k) into the doorbell, which the engine
  reads before every adapter lookup. Nothing the engine reads is written: a request keeps the slot it was
  admitted with, rewritten only `adapter_slots` pushes later.
- EngineMerge: the same ring, and the handshake words of wire/colocated_words.py. With one trainer rank the engine
  maps the trainer's flat adapter too (the plan's `gather`) and a push is one device context's work
  (`EngineMergeMode.fold_on_engine`): the trainer synchronises its step and stores THRESH, ARG = (version, k) and
  REQ = n (and a wake byte), then waits (bounded) for each engine's ACK n: its watcher takes the weight lock,
  gathers the adapter into slot k with the delta number against slot k-1 in one pass, folds slot k into its
  pristine base (the HTTP path's lora_merge, one weight write; on a GPU two CUDA-graph replays), synchronises, and
  on a delta-skip folds slot k-1 (the last push) back in; the version set under the lock
  (kora_engine/lm/colocated_gather.py). With a trainer group the trainer decides (MAX over its ranks), gathers
  the slot and then makes the request.
- Merge: the engine hands over its parameters and the handshake words. A push stores REQ = n first (the engine
  takes its weight lock: generation in flight gives way at its next step and recomputes its KV cache after),
  reads the delta decision meanwhile, waits for GRANT n, folds W + s·B·A straight into the mapped weights
  (`colocated_merge.ColocatedMerge`, the adapted weights only: the HTTP path's first push wrote every tensor and the
  engines' checksums proved it; the frozen ones never change after), synchronises, stores DONE n (DARG: version,
  full 0) and waits for ACK n (names replaced, version set, lock given back). The first fast push is verified over
  every tensor the engine serves (`full`), which proves the mapping is the engine's memory for all of them. A skip
  or a failure stores DONE -n: the lock back, nothing changed. An engine that does not answer within the
  transport's timeout fails the sync with a SyncError naming it and the word it did not write; a write that
  outlives its lease (the same timeout) is taken as torn by the engine and refused here.
- The delta decision is enqueued first and read after the push's own synchronise (Adapter, EngineMerge: the slot
  is packed before the decision: it is the slot the ring reuses next, read by nobody) or while the engine takes
  its lock (Merge): no host read of its own on the push's critical path. With one trainer rank, Adapter and
  EngineMerge decide in the gather's own pass against the slot pushed before (`ring.Decision.plan`; else `FlatDelta`),
  and on a GPU the decision and the slot's gather are one captured CUDA graph per ring slot (`ring.Decision.capture`).

Where a push's time goes (`SyncReport.phases`, ms): `decide` (the delta decision; Adapter and EngineMerge: with the
slot's gather and its synchronise), then Adapter `ring` (the doorbell store); EngineMerge `engine` (REQ stored to
every ACK seen) of which `engine_spent` is engine 0's own account (the SPENT word: its fold, synchronise and
version) and `engine_fold` the fold's device time there (the WORK word, on a GPU), and the moments in between
(`handshake.engine_laps`); Merge `lock` (to every
GRANT), `write` (the fold and copies into the mapped weights, synchronised) and `ack` (DONE to every ACK).
`verify_ms`: a verified push's checksum call, after the engines serve the push, and outside the push's `ms` (its
hashing is left out of both, as on the HTTP path).

Checksums: Adapter, every push, `protocol.PackedChecksum` of the slot's bytes; Merge, on verified pushes (the
first and every `VERIFY_EVERY`-th) `protocol.checksum` of every tensor written, in order. The engine computes
the same over what it serves on verified pushes and a difference fails the sync: both read one memory, so
this proves the engine serves the memory the trainer wrote (a stale mapping shows on the first push).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from kora_trainer.sync.fast.adapter_pack import flatten_parameters
from kora_trainer.sync.fast.base import FastSender
from kora_trainer.sync.fast.colocated_modes import MODES, ColocatedMode, Context
from kora_trainer.sync.fast.handshake import Handshake, Laps
from kora_trainer.sync.fast.ring import Decision, sync_device
from kora_trainer.sync.sender import SyncReport
from kora_trainer.sync.transport import ColocatedTransport, SyncError
from kora_trainer.wire.engine_client import EngineClient, EngineError
from kora_trainer.wire.serialize import deserialize_payload


class ColocatedFastSender(FastSender):
    """`Sender` (sync/sender.py) over the colocated fast path after the HTTP path's first push: the steps, in one
    order for every mode; the mode's strategy object (`how`, colocated_modes.py) fills them in."""

    transport_type = ColocatedTransport

    def __init__(self, http: Any, adapter_slots: int = 3, **kw: Any):
        super().__init__(http, adapter_slots=adapter_slots, **kw)
        self.hand = Handshake(self.transport, self.mode)  # Merge, EngineMerge: each engine's words and wake
        self.clock = Laps()  # this push's phases (ms), see the module docstring
        self.how: ColocatedMode = MODES[self.mode](Context(
            self.mode, self.transport, self.hand, self.clock, adapter_slots, self.trainer_group, self.adapter_config,
            self.lora, lambda: sync_device(self.flat)))
        self.decision: Decision | None = None

    @property
    def engine_gathers(self) -> bool:
        """EngineMerge: the engines gather the slot and decide (`EngineMergeMode.fold_on_engine`)."""
        return self.how.engine_gathers

    # ---- the plan, once -----------------------------------------------------------------------------------

    def _plan(self) -> str:
        device = self.policy.fast_adapter_params()[0].device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        try:
            self.how.make_plan(self.policy, self.cap)  # what it cannot cover raises here, before the parameters move
            flat = flatten_parameters(self.policy.fast_adapter_params())
            plan = self.how.make_plan(self.policy, self.cap)  # over the flat parameters
            body = self.how.body(plan, flat)
        except (NotImplementedError, ValueError, KeyError) as e:
            return self._off(f"the policy: {e}")
        answers, refused = self._ask_plan(body)
        if refused:
            return self._off("; ".join(refused))
        mapped = [deserialize_payload(a["payload"]) for a in answers]
        try:
            self.nbytes, self.nbuckets = self.how.take(plan, answers, mapped, device)
        except (NotImplementedError, ValueError, KeyError) as e:
            self.how.drop()
            self.hand.close()
            return self._off(f"the engine's memory: {e}")
        self.flat = flat
        self.decision = Decision(flat, self.trainer_group, self.how.ring, self.how.runs)
        self.delta = self.decision.delta
        sync_device(flat)
        self.how.ready(answers)
        if not self.how.engine_gathers:  # else the engines hold the decision's state
            self.decision.plan(self.pushes, [-1] if self.how.ring is None else list(range(self.adapter_slots)))
        self.active = True
        return self._on_note(len(mapped))

    def _on_note(self, engines: int) -> str:
        scratch = self.how.scratch  # weights the engine holds apart: fold, then copy
        slow = sorted({w.problem for w in self.hand.wakers if w.problem})  # the engine then reads the words on its poll
        return (f"fast path on (colocated, in memory): {self.nbytes} B per push into {engines} engine(s)"
                + (f", {scratch} fold(s) through a scratch buffer" if scratch else "")
                + (", the push handshake in shared memory" if self.hand.words else "")
                + (f" (no wake: {slow[0]})" if slow else ""))

    def _ask_plan(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
        clients: list[EngineClient] = self.transport.clients
        futs = [c.submit(c.colocated, "plan", body) for c in clients]
        answers, refused = [], []
        for c, f in zip(clients, futs, strict=True):
            try:
                answers.append(f.result(timeout=self.transport.timeout_s))
            except EngineError as e:
                refused.append(f"{c.base_url} has no colocated route (HTTP 404: not kora's hf engine)"
                               if e.status == 404 else f"{c.base_url} refused the plan: {e.message}")
            except TimeoutError:
                refused.append(f"{c.base_url} did not answer the plan in {self.transport.timeout_s:.0f} s")
        return answers, refused

    # ---- a push -------------------------------------------------------------------------------------------

    def arm(self) -> None:
        """`Sender.arm`: the mode's (EngineMerge with `gather`: ARM the next request; the others: nothing)."""
        if self.active:
            self.how.arm(self.pushes)

    def _push(self, version: int) -> SyncReport:
        assert self.flat is not None and self.decision is not None
        t0 = self.clock.start()
        n = self.hand.next()
        if self.how.engine_gathers:  # EngineMerge: the engine gathers, folds and decides
            push, delta, slot = self.how.fold_on_engine(version, n, self.pushes, self.threshold)
        else:
            push, delta, slot = self._decide(n)
            self.clock.lap("decide")
        if not push:
            return self._skipped(version, n, delta, t0)
        verify = self.verify and self.pushes % self.verify_every == 0
        full = self.pushes == 0  # Merge: the checksum covers every tensor (the write is the adapted weights')
        self.how.publish(version, n, slot)
        ms = (self.clock.t - t0) * 1000  # the last phase's end: the engines serve the push from there on
        results = self._verified(slot, full) if verify else []
        self.decision.mark_pushed()
        self.pushes += 1
        self.engine_version = version
        digest = self.how.digest(self.pushes, verify, full)
        if verify:
            bad = [f"{c.base_url}: {r.get('checksum')}" for c, r in zip(self.transport.clients, results, strict=True)
                   if r.get("checksum") != digest]
            if bad:
                raise SyncError(f"an engine serves other bytes than were written ({bad[0]} != {digest})")
        return SyncReport(mode=str(self.mode), transport=self.transport.kind, pushed=True,
                          bytes=self.how.written(self.nbytes), ms=round(ms, 2), adapter_version=version,
                          checksum=digest, buckets=self.nbuckets, max_delta=delta, what=self.how.what, path="fast",
                          phases=dict(self.clock.laps))

    def _decide(self, n: int) -> tuple[bool, float, int]:
        """The delta decision (push?, max delta) and the ring slot packed (-1: Merge), with no host read of its own:
        Merge asks for the weight locks (request n) first and reads the number while they are granted; Adapter and
        EngineMerge pack the slot the ring reuses next (read by nobody) and read it after that synchronise."""
        assert self.decision is not None
        self.how.before_decide(n)
        try:
            slot = self.how.slot(self.pushes)
            return (*self.decision.delta.decide(self.decision.pending(slot), self.threshold), slot)
        except BaseException:
            self.how.decide_failed(n)
            raise

    def _skipped(self, version: int, n: int, delta: float, t0: float) -> SyncReport:
        self.how.skipped(version, n)
        skip = SyncReport.skip(str(self.mode), self.transport.kind, self.engine_version, delta, path="fast")
        if self.how.engine_gathers:  # the engine folded and put the last push back: what that took
            skip = replace(skip, ms=round((time.perf_counter() - t0) * 1000, 2), phases=dict(self.clock.laps))
        return skip

    def _verified(self, slot: int, full: bool) -> list[dict[str, Any]]:
        """The engines' checksums of what they serve now; their hashing left out of `verify_ms`, as on the HTTP
        path (they ran in parallel: the slowest)."""
        results = self.how.verified(slot, full)
        self.clock.lap("verify_ms")
        self.clock.laps["verify_ms"] -= max((r.get("checksum_ms") or 0.0 for r in results), default=0.0)
        return results

    def close(self) -> None:
        if self.decision is not None:
            self.decision.close()
        self.hand.close()
        super().close()
