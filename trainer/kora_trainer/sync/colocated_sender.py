"""The fast path of weight sync for colocated engines: the trainer writes each push straight into the memory of
the engines beside it, mapped once (CUDA IPC on GPU, shared memory on CPU). The engine's side is
kora_engine/lm/colocated_routes.py; `fast_sender.with_fast_path` picks this sender for a `ColocatedTransport`.

The steps are `FastWeightSender`'s: the first sync is the HTTP path's (checked by the engines' checksums), then
one plan, then every later push on the fast path (delta-skip by `FlatDelta`, collective over the trainer's
group), with the HTTP path kept — and the reason printed — wherever the plan cannot cover the policy or an
engine has no route (404: SGLang).

No HTTP call per push in the steady state, in any mode (verified pushes add one per engine, for its checksum):

- Adapter: the engine makes a ring of `adapter_slots` flat buffers laid out as `AdapterPack.metadata` says, and a
  doorbell word in shared memory, and hands them over; a push is one gather (`AdapterPack.pack_into`) into slot
  k (cycling in order), a synchronise, and one 8-byte store of (version, k) into the doorbell, which the engine
  reads before every adapter lookup. Nothing the engine reads is written: a request keeps the slot it was
  admitted with, rewritten only `adapter_slots` pushes later.
- EngineMerge: the same ring, and the handshake words of wire/colocated_words.py. With one trainer rank the
  engine maps the trainer's flat adapter too (the plan's `gather`) and a push is one device context's work
  (`_fold_on_engine`): the trainer synchronises its step and stores THRESH, ARG = (version, k) and REQ = n (and a
  wake byte), then waits (bounded) for each engine's ACK n: its watcher takes the weight lock, gathers the adapter
  into slot k with the delta number against slot k-1 in one pass, folds slot k into its pristine base (the HTTP
  path's lora_merge, one weight write; on a GPU two CUDA-graph replays), synchronises, and on a delta-skip folds
  slot k-1 (the last push) back in; the version set under the lock (kora_engine/lm/colocated_gather.py). With
  a trainer group the trainer decides (MAX over its ranks), gathers the slot and then makes the request.
- Merge: the engine hands over its parameters and the handshake words. A push stores REQ = n first (the engine
  takes its weight lock: generation in flight gives way at its next step and recomputes its KV cache after),
  reads the delta decision meanwhile, waits for GRANT n, folds W + s·B·A straight into the mapped weights
  (`colocated.ColocatedMerge`, the adapted weights only: the HTTP path's first push wrote every tensor and the
  engines' checksums proved it; the frozen ones never change after), synchronises, stores DONE n (DARG: version,
  full 0) and waits for ACK n (names replaced, version set, lock given back). The first fast push is verified over
  every tensor the engine serves (`full`), which proves the mapping is the engine's memory for all of them. A skip
  or a failure stores DONE -n: the lock back, nothing changed. An engine that does not answer within the
  transport's timeout fails the sync with a SyncError naming it and the word it did not write; a write that
  outlives its lease (the same timeout) is taken as torn by the engine and refused here.
- The delta decision is enqueued first and read after the push's own synchronise (Adapter, EngineMerge: the slot
  is packed before the decision: it is the slot the ring reuses next, read by nobody) or while the engine takes
  its lock (Merge): no host read of its own on the push's critical path. With one trainer rank, Adapter and
  EngineMerge decide in the gather's own pass against the slot pushed before (`_plan_decide`; else `FlatDelta`),
  and on a GPU the decision and the slot's gather are one captured CUDA graph per ring slot (`_capture_decide`).

Where a push's time goes (`SyncReport.phases`, ms): `decide` (the delta decision; Adapter and EngineMerge: with the
slot's gather and its synchronise), then Adapter `ring` (the doorbell store); EngineMerge `engine` (REQ stored to
every ACK seen) of which `engine_spent` is engine 0's own account (the SPENT word: its fold, synchronise and
version) and `engine_fold` the fold's device time there (the WORK word, on a GPU), and the moments in between
(`_engine_laps`); Merge `lock` (to every
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
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from kora_trainer.config import SyncMode
from kora_trainer.kernels.gather_delta import gather, gather_max_delta, runs_of
from kora_trainer.sync.colocated import ColocatedMerge
from kora_trainer.sync.fast import FoldEntry, PlainEntry
from kora_trainer.sync.fast_adapter import AdapterPack, FlatDelta, flatten_parameters
from kora_trainer.sync.fast_sender import FastWeightSender
from kora_trainer.sync.sender import POLICY_ADAPTER, SyncReport
from kora_trainer.sync.transport import ColocatedTransport, SyncError, wait_all
from kora_trainer.wire.colocated_words import (
    ACK,
    ARG,
    ARM,
    ARM_SLOT,
    DARG,
    DELTA,
    DONE,
    ERR,
    ERRORS,
    GATE,
    GRANT,
    LAUNCH_CPU,
    PRELAUNCHED,
    PUSHED,
    REQ,
    SPENT,
    SPUN,
    T_ACK,
    T_GATHERED,
    T_LAUNCHED,
    T_LOCKED,
    T_LOCKING,
    T_SEEN,
    T_SYNCED,
    T_WARMED,
    THRESH,
    WARMED,
    WORK,
    Waker,
    Words,
    float_word,
    now_us,
    wait_word,
    word_float,
)
from kora_trainer.wire.engine_client import EngineClient, EngineError
from kora_trainer.wire.fast_receive import doorbell_value
from kora_trainer.wire.protocol import PackedChecksum, checksum
from kora_trainer.wire.serialize import deserialize_payload, serialize_payload


def written_names(merge_entries: list[Any], full: bool) -> list[str]:
    """The engine tensors a Merge push names, in order: every adapted weight (what it writes); with `full` the
    frozen ones too (what the first fast push's checksum covers)."""
    names = []
    for e in merge_entries:
        if isinstance(e, FoldEntry) and (full or e.a is not None):
            names += [n for n, _ in e.outs]
        elif isinstance(e, PlainEntry) and full:
            names.append(e.name)
    return names


class ColocatedFastSender(FastWeightSender):
    """`WeightSender.sync`'s contract over the colocated fast path after the HTTP path's first push."""

    transport_type = ColocatedTransport

    def __init__(self, http: Any, adapter_slots: int = 3, **kw: Any):
        super().__init__(http, adapter_slots=adapter_slots, **kw)
        self.merges: list[ColocatedMerge] = []  # Merge: one per engine
        self.slots: list[list[torch.Tensor]] = []  # Adapter: each engine's ring buffers, mapped
        self.doorbells: list[torch.Tensor] = []  # Adapter: each engine's doorbell word (CPU, shared)
        self.names: dict[bool, list[str]] = {}  # Merge: full -> what a push writes
        self.targets: list[dict[str, torch.Tensor]] = []  # Merge: each engine's parameters, mapped
        self.words: list[Words] = []  # Merge, EngineMerge: each engine's handshake words (CPU, shared)
        self.wakers: list[Waker] = []  # ... and its wake FIFO
        self.seq = 0  # Merge, EngineMerge: the last request made through the handshake
        self.answered = 0  # ... and the last one every engine answered
        self.laps: dict[str, float] = {}  # this push's phases (ms), see the module docstring
        # ring slot k (-1: Merge) -> the captured decision (and gather) and the number it leaves (_capture_decide)
        self.decide_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # ... compared with the previous ring slot in the gather's own pass: (row starts, run, engine 0's slots)
        self.fused_decide: tuple[torch.Tensor, int, list[torch.Tensor]] | None = None
        self.number = torch.zeros(1)  # ... the number the fused decision leaves (on the adapter's device)
        self.runs: tuple[torch.Tensor, int] | None = None  # one rank: the slot's gather index as runs (runs_of)
        self.engine_gathers = False  # EngineMerge: the engines gather the slot and decide (`_fold_on_engine`)
        self.lap_t = 0.0

    # ---- the plan, once -----------------------------------------------------------------------------------

    def _make_plan(self) -> Any:
        """What a push writes (raises for what the colocated path does not cover). No buckets: sync.bufferSize
        does not bound a fold written in place."""
        if self.mode is SyncMode.MERGE:
            return self.http.fast_merge_entries()
        # Adapter, EngineMerge: the HF-PEFT pairs
        return AdapterPack(self.http.fast_adapter_params(), self.http.fast_adapter_specs(), self.http.cap)

    def _plan(self) -> str:
        device = self.http.fast_adapter_params()[0].device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        try:
            self._make_plan()  # what the plan cannot cover raises here, before the parameters are touched
            flat = flatten_parameters(self.http.fast_adapter_params())
            plan = self._make_plan()  # over the flat parameters
            if self.mode is SyncMode.MERGE:
                entries = plan
                # the engine holds what megatron fuses (q;k;v, gate;up) apart: one buffer each, folded into at once
                fuse = [[n for n, _ in e.outs] for e in entries if isinstance(e, FoldEntry) and len(e.outs) > 1]
                self.names = {full: written_names(entries, full) for full in (True, False)}
                body: dict[str, Any] = {"mode": "Merge", "fuse": fuse, "lease_s": min(self.transport.timeout_s, 3600.0),
                                        "names": {"full": self.names[True], "adapted": self.names[False]}}
            else:
                pack = plan
                self.runs = self._one_rank_runs(pack, flat)
                body = {"mode": str(self.mode), "metadata": pack.metadata, "slots": self.adapter_slots,
                        "lora_name": POLICY_ADAPTER, "config_dict": self.http.adapter_config}
                if self.mode is SyncMode.ENGINE_MERGE:  # the HTTP path's lora_merge parameters
                    lora = self.http.cfg.lora
                    body.update(lora_alpha=lora.alpha, lora_rank=lora.rank, merge_fp32=True)
                    if self.runs is not None:  # one context for the push: the engine maps the flat adapter
                        starts, run = self.runs
                        body["gather"] = {"payload": serialize_payload([("flat", flat), ("starts", starts)]),
                                          "run": run, "numel": pack.out.numel(), "dtype": str(pack.dtype)}
        except (NotImplementedError, ValueError, KeyError) as e:
            return self._off(f"the policy: {e}")
        answers, refused = self._ask_plan(body)
        if refused:
            return self._off("; ".join(refused))
        mapped = [deserialize_payload(a["payload"]) for a in answers]
        try:
            if self.mode is not SyncMode.ADAPTER:
                self._handshake(answers, mapped)
            if self.mode is SyncMode.MERGE:
                self.targets = [self._on(dict(m), device) for m in mapped]
                self.merges = [ColocatedMerge(entries, dst) for dst in self.targets]
                for merge in self.merges:
                    merge.prepare(full=False)
                self.nbytes, self.nbuckets = self.merges[0].nbytes, 1
            else:
                self.pack = pack
                need = pack.out.numel() * pack.out.element_size()
                named = [dict(m) for m in mapped]
                self.doorbells = [n.pop("doorbell") for n in named if "doorbell" in n]
                self.slots = [list(self._on(n, device).values()) for n in named]
                if any(len(s) != self.adapter_slots or s[0].numel() < need for s in self.slots):
                    raise ValueError(f"an engine's ring is not {self.adapter_slots} slots of {need} B")
                self.packed = PackedChecksum([(n, pack.dtype, s) for n, s in zip(pack.names, pack.shapes,
                                                                                 strict=True)], device)
                self.nbytes, self.nbuckets = need, 1
        except (NotImplementedError, ValueError, KeyError) as e:
            self.merges, self.slots, self.doorbells, self.targets, self.pack = [], [], [], [], None
            self._close_wakers()
            return self._off(f"the engine's memory: {e}")
        self.flat, self.delta = flat, FlatDelta(flat)
        if self.runs is None:  # else the ring slot pushed last is the record (`_plan_decide`, or the engine's)
            self.delta.mark_pushed(flat)  # what the HTTP push just sent
            self.delta.local_max(flat)  # the decision's kernels load now (compiled on first use), not in a push
        self._sync_device()
        self.engine_gathers = self.mode is SyncMode.ENGINE_MERGE and all(a.get("gathers") for a in answers)
        self._plan_decide()
        self.active = True
        scratch = sum(m.scratch_entries for m in self.merges)  # weights the engine holds apart: fold, then copy
        slow = sorted({w.problem for w in self.wakers if w.problem})  # the engine then reads the words on its poll
        return (f"fast path on (colocated, in memory): {self.nbytes} B per push into {len(mapped)} engine(s)"
                + (f", {scratch} fold(s) through a scratch buffer" if scratch else "")
                + (", the push handshake in shared memory" if self.words else "")
                + (f" (no wake: {slow[0]})" if slow else ""))

    def _handshake(self, answers: list[dict[str, Any]], mapped: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Merge, EngineMerge: each engine's handshake words (taken out of its mapped tensors) and wake FIFO."""
        for answer, named in zip(answers, mapped, strict=True):
            words = dict(named).get("handshake")
            if words is None:
                raise ValueError("the engine hands over no push handshake (wire/colocated_words.py)")
            self.words.append(Words(words))
            self.wakers.append(Waker(answer.get("wake")))
            named[:] = [(n, t) for n, t in named if n != "handshake"]

    def _close_wakers(self) -> None:
        for waker in self.wakers:
            waker.close()
        self.words, self.wakers = [], []

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

    @staticmethod
    def _on(named: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        wrong = {str(t.device) for t in named.values() if t.device != device}
        if wrong:
            raise ValueError(f"the engine's tensors are on {sorted(wrong)}, the trainer's on {device}")
        return named

    # ---- a push -------------------------------------------------------------------------------------------

    def _lap(self, name: str) -> None:
        """Close the phase `name` of this push (ms since the previous lap)."""
        now = time.perf_counter()
        self.laps[name] = round((now - self.lap_t) * 1000, 3)
        self.lap_t = now

    def _push(self, version: int) -> SyncReport:
        assert self.flat is not None and self.delta is not None
        t0 = self.lap_t = time.perf_counter()
        self.laps = {}
        mode = str(self.mode)
        self._settled()
        n = self.seq = self.seq + 1
        if self.engine_gathers:  # EngineMerge: the engine gathers, folds and decides (`_fold_on_engine`)
            push, delta, slot = self._fold_on_engine(version, n)
        else:
            push, delta, slot = self._decide(n)
            self._lap("decide")
        if not push:
            if self.merges:
                self._store(DARG, 0, DONE, -n)  # the locks back, unused
                self._acks(n, f"giving the weight lock back unused (delta-skip of version {version})")
            skip = SyncReport.skip(mode, self.transport.kind, self.engine_version, delta, path="fast")
            if self.engine_gathers:  # the engine folded and put the last push back: what that took
                skip = replace(skip, ms=round((time.perf_counter() - t0) * 1000, 2), phases=dict(self.laps))
            return skip
        verify = self.http.verify and self.pushes % self.verify_every == 0
        full = self.pushes == 0  # Merge: the checksum covers every tensor (the write is the adapted weights')
        if self.merges:
            self._merge(version, n)
        elif self.mode is SyncMode.ENGINE_MERGE and not self.engine_gathers:
            asked = now_us()
            self._store(ARG, doorbell_value(version, slot), REQ, n)
            self._engine_answered(n, f"folding ring slot {slot} as version {version}", asked)
        elif self.mode is SyncMode.ADAPTER:
            self._ring(version, slot)
            self._lap("ring")
        ms = (self.lap_t - t0) * 1000  # the last phase's end: the engines serve the push from there on
        results = self._verified(slot, full) if verify else []
        if verify:  # hashing left out, as on the HTTP path: the engines' checksums ran in parallel, the slowest
            self._lap("verify_ms")
            self.laps["verify_ms"] -= max((r.get("checksum_ms") or 0.0 for r in results), default=0.0)
        if self.runs is None:  # else the slot just pushed is the record
            self.delta.mark_pushed(self.flat)
        self.pushes += 1
        self.engine_version = version
        digest = self._digest(verify, full)
        if verify:
            bad = [f"{c.base_url}: {r.get('checksum')}" for c, r in zip(self.transport.clients, results, strict=True)
                   if r.get("checksum") != digest]
            if bad:
                raise SyncError(f"an engine serves other bytes than were written ({bad[0]} != {digest})")
        nbytes = self.merges[0].adapted_bytes if self.merges else self.nbytes  # what was written
        return SyncReport(mode=mode, transport=self.transport.kind, pushed=True, bytes=nbytes, ms=round(ms, 2),
                          adapter_version=version, checksum=digest, buckets=self.nbuckets, max_delta=delta,
                          what=self._what(), path="fast", phases=dict(self.laps))

    def arm(self) -> None:
        """EngineMerge with `gather`: ARM the next request with the slot it will name, so each engine's watcher holds
        its weight lock for it, has enqueued its gather and fold behind GATE (on a GPU; else warmed their launch)
        and is spinning when the request comes (wire/colocated_words.py). The step's update is made whole here, so
        the push's own synchronise finds the device idle."""
        if not (self.active and self.engine_gathers):
            return
        self._sync_device()
        for words in self.words:
            words[ARM_SLOT] = self.pushes % self.adapter_slots  # `_fold_on_engine`'s slot: no push in between
            words[ARM] = self.seq + 1
        for wake in self.wakers:
            wake()

    def _fold_on_engine(self, version: int, n: int) -> tuple[bool, float, int]:
        """EngineMerge with the plan's `gather`: the step's update whole on the device (synchronised), then request
        n — the engine gathers slot k from the flat adapter, folds it, decides against THRESH and on a skip folds
        the last push back in — and the ACK; the decision and the number are the engine's (PUSHED, DELTA)."""
        slot = self.pushes % self.adapter_slots
        self._sync_device()
        self._lap("sync")
        asked = now_us()
        threshold = float_word(self.http.threshold)
        for words in self.words:
            words[GATE] = n  # first: an engine that prelaunched request n has its GPU waiting on this word
            words[THRESH] = threshold
        self._store(ARG, doorbell_value(version, slot), REQ, n)
        self._engine_answered(n, f"gathering and folding ring slot {slot} as version {version}", asked)
        pushed = {words[PUSHED] == n for words in self.words}
        if len(pushed) > 1:  # one adapter, one threshold, one record of the last push: never apart
            raise SyncError(f"colocated EngineMerge push {n}: the engines decided the delta-skip apart")
        return pushed.pop(), max(word_float(words[DELTA]) for words in self.words), slot

    def _engine_answered(self, n: int, what: str, asked: int) -> None:
        """Every engine's ACK n, then engine 0's account of the push (`engine`, `engine_spent`, the moments)."""
        self._acks(n, what)
        self._lap("engine")
        self._engine_laps(asked, now_us(), n)
        self.laps["engine_spent"] = self.words[0][SPENT] / 1000
        if self.words[0][WORK]:
            self.laps["engine_fold"] = self.words[0][WORK] / 1000

    def _engine_laps(self, asked: int, answered: int, n: int) -> None:
        """Engine 0's EngineMerge push, moment by moment (the T_ words, one clock for both processes): from the
        request's store to its watcher reading it (`engine_wake`), its weight lock held (`engine_lock`), the fold
        enqueued (`engine_launch`, of which `engine_launch_cpu` the thread's CPU), done on the device
        (`engine_wait`), the ACK stored (`engine_after`), and the ACK seen here (`ack_notice`). Inside those:
        `engine_prelude`, the handler's own work before it asks for the lock (of `engine_lock`), and
        `engine_gather_launch`, the lock held to the gather enqueued (of `engine_launch`, with `gather`). An armed
        push (`arm`) adds `engine_warmed_ahead`, how long before the request the engine's warm-up (or prelaunch)
        was done, `engine_spun`, 1 when the request found the watcher spinning rather than asleep, and
        `engine_prelaunched`, 1 when its gather and fold were enqueued at the arm behind GATE (then the lock and
        the launch marks are the request's reading: they happened before it)."""
        w = self.words[0]
        marks = [asked, w[T_SEEN], w[T_LOCKED], w[T_LAUNCHED], w[T_SYNCED], w[T_ACK], answered]
        if not all(marks):
            return
        names = ["engine_wake", "engine_lock", "engine_launch", "engine_wait", "engine_after", "ack_notice"]
        for name, a, b in zip(names, marks, marks[1:], strict=False):
            self.laps[name] = (b - a) / 1000
        self.laps["engine_launch_cpu"] = w[LAUNCH_CPU] / 1000
        if w[T_LOCKING]:
            self.laps["engine_prelude"] = (w[T_LOCKING] - w[T_SEEN]) / 1000
        if w[T_GATHERED]:
            self.laps["engine_gather_launch"] = (w[T_GATHERED] - w[T_LOCKED]) / 1000
        if w[WARMED] == n:
            self.laps["engine_warmed_ahead"] = (asked - w[T_WARMED]) / 1000
            self.laps["engine_spun"] = float(w[SPUN] == n)
            self.laps["engine_prelaunched"] = float(w[PRELAUNCHED] == n)

    def _decide(self, n: int) -> tuple[bool, float, int]:
        """The delta decision (push?, max delta) and the ring slot packed (-1: Merge), with no host read of its own:
        Merge asks for the weight locks (request n) first and reads the number while they are granted; Adapter and
        EngineMerge pack the slot the ring reuses next (read by nobody) and read it after that synchronise."""
        assert self.flat is not None and self.delta is not None
        if self.merges:
            self._store(ARG, 0, REQ, n)
        try:
            slot = -1 if self.merges else self.pushes % self.adapter_slots
            captured = self.decide_graphs.get(slot)
            if captured is not None:
                graph, pending = captured
                graph.replay()
                self._sync_device()  # the number in pinned memory, the slot whole before the engine is told
            elif slot >= 0 and self.fused_decide is not None:
                pending = self._fused_decide(slot)
                self._sync_device()
            else:
                pending = self.delta.pending(self.flat, self.http.trainer_group)
                if slot >= 0:
                    self._pack_slot(slot)
            return (*self.delta.decide(pending, self.http.threshold), slot)
        except BaseException:
            if self.merges:
                self._store(DARG, 0, DONE, -n)  # the locks back before failing the sync
            raise

    def _what(self) -> str:
        if self.merges:
            return "adapted"
        return "lora_pairs" if self.mode is SyncMode.ENGINE_MERGE else "adapter"

    def _sync_device(self) -> None:
        assert self.flat is not None
        if self.flat.is_cuda:
            torch.cuda.synchronize(self.flat.device)

    def _all(self, step: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        clients = self.transport.clients
        return wait_all([c.submit(c.colocated, step, b) for c, b in zip(clients, bodies, strict=True)],
                        self.transport.timeout_s)

    # ---- the handshake (wire/colocated_words.py) ----------------------------------------------------------

    def _store(self, arg_word: int, arg: int, word: int, value: int) -> None:
        """Every engine: `arg` into `arg_word`, then `value` into `word` (what publishes it), then its wake."""
        for words in self.words:
            words[arg_word] = arg
            words[word] = value
        for wake in self.wakers:
            wake()

    def _wait(self, word: int, accept: Callable[[int], bool], what: str) -> list[int]:
        """Each engine's `word` once `accept`ed, bounded by the transport's timeout: a SyncError naming the engine
        and what it did not answer, never a hang."""
        got = []
        for c, words in zip(self.transport.clients, self.words, strict=True):
            try:
                got.append(wait_word(words, word, accept, self.transport.timeout_s, f"{c.base_url} {what}"))
            except TimeoutError as e:
                raise SyncError(f"colocated {self.mode} push: {e} (the engine's handshake watcher is gone or "
                                f"stuck; sync.transportTimeoutS bounds the wait)") from None
        return got

    def _settled(self) -> None:
        """A request is made only once every engine answered the one before (after a timeout the engine may
        still be working on it: reading the ring slot, holding its lock)."""
        n = self.seq
        if self.words and self.answered != n:
            self._acks(n, "still unanswered from a push that timed out")

    def _acks(self, n: int, what: str) -> None:
        acks = self._wait(ACK, lambda v: v in (n, -n), f"did not acknowledge push {n} ({what})")
        self.answered = n
        refused = [f"{c.base_url}: {ERRORS.get(words[ERR], 'refused')}" for c, words, a in
                   zip(self.transport.clients, self.words, acks, strict=True) if a == -n]
        if refused:
            raise SyncError(f"colocated {self.mode} push {n} ({what}) refused by {'; '.join(refused)}")

    def _merge(self, version: int, n: int) -> None:
        """Request n was made before the delta decision; once every engine holds its weight lock, the fold
        writes the adapted weights straight into the mapped ones, then DONE (with the version) and the
        acknowledgements."""
        try:
            self._wait(GRANT, lambda v: v == n, f"did not grant its weight lock for push {n} (version {version})")
            self._lap("lock")
            for merge in self.merges:
                merge.push(full=False)
            self._sync_device()
            self._lap("write")
        except BaseException:
            self._store(DARG, 0, DONE, -n)  # every engine's lock back before failing the sync
            raise
        self._store(DARG, doorbell_value(version, 0), DONE, n)
        self._acks(n, f"setting version {version} after the write")
        self._lap("ack")

    def _pack_slot(self, k: int) -> None:
        """The pairs gathered into ring slot k of every engine, whole on the device."""
        assert self.pack is not None
        for ring in self.slots:
            self.pack.pack_into(ring[k])
        self._sync_device()

    def _one_rank_runs(self, pack: AdapterPack, flat: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """With one trainer rank (no group to all-reduce the number over) and a ring of two slots or more, the
        slot's gather index as runs (kernels/gather_delta.runs_of): the delta decision is then taken in the
        gather's own pass, here (Adapter) or on the engine (EngineMerge, the plan's `gather`). Else None."""
        group = self.http.trainer_group
        if (group is not None and group.world_size > 1) or pack.tp is not None or pack.flat is None \
                or self.adapter_slots < 2 or pack.flat.data_ptr() != flat.data_ptr() \
                or pack.flat.numel() != flat.numel():
            return None
        return runs_of(pack.index)

    def _plan_decide(self) -> None:
        """With `runs` (one trainer rank), Adapter decides in the slot's gather's own pass (kernels/gather_delta.py):
        slot k is compared element by element with the slot pushed before it, which holds exactly what the
        engines were last given (the HTTP push's adapter is gathered into it here), so no copy of the last push is
        kept or updated. Then, on a GPU, `_capture_decide`. An engine that gathers (EngineMerge) holds all that
        itself: nothing to plan here."""
        assert self.flat is not None
        if self.engine_gathers:
            return
        pack, flat = self.pack, self.flat
        self.number = torch.zeros(1, dtype=torch.float32, device=flat.device)
        if pack is not None and self.runs is not None and self.slots:
            starts, run = self.runs
            views = [pack.view_of(s) for s in self.slots[0]]
            gather(flat, starts, views[(self.pushes - 1) % len(views)], run)  # the slot pushed last: what is served
            gather_max_delta(flat, starts, views[0], self.number, pack.out, run)  # compiled now, not in a push
            self.fused_decide = (starts, run, views)  # a captured graph reads the index: it lives as long as they do
        if flat.is_cuda:
            self._capture_decide()

    def _fused_decide(self, k: int) -> torch.Tensor:
        """Slot k gathered (every engine's) and the number against the slot pushed before it, enqueued."""
        assert self.fused_decide is not None and self.flat is not None and self.pack is not None
        starts, run, views = self.fused_decide
        gather_max_delta(self.flat, starts, views[(k - 1) % len(views)], self.number, views[k], run)
        for ring in self.slots[1:]:
            self.pack.pack_into(ring[k])
        return self.number

    def _capture_decide(self) -> None:
        """On a GPU: the delta decision's number and (Adapter, EngineMerge) the gather into ring slot k, captured
        once per slot as one CUDA graph, so the host work of a push before the handshake is one replay, one
        synchronise and one read of pinned memory. Launched op by op from the trainer's actor, those few kernels
        cost several times their device time in host time. The graphs read the flat adapter and the ring slots,
        all at fixed addresses from here on."""
        assert self.flat is not None and self.delta is not None
        device, pack = self.flat.device, self.pack
        if pack is not None:  # the gather's kernel loaded outside the capture (into the pack's own buffer)
            pack.pack()
        torch.cuda.synchronize(device)
        pool = torch.cuda.graph_pool_handle()  # one pool: the graphs are replayed one at a time
        for k in [-1] if self.merges else range(self.adapter_slots):
            graph = torch.cuda.CUDAGraph()
            host = torch.zeros(1, dtype=torch.float32, pin_memory=True)  # read after the synchronise, no copy call
            with torch.cuda.graph(graph, pool=pool):
                if k >= 0 and self.fused_decide is not None:
                    number = self._fused_decide(k)
                else:
                    number = self.delta.local_max(self.flat)
                    for ring in self.slots if k >= 0 else []:
                        assert pack is not None
                        pack.pack_into(ring[k])
                host.copy_(number, non_blocking=True)
            self.decide_graphs[k] = (graph, host)
        torch.cuda.synchronize(device)

    def _ring(self, version: int, k: int) -> None:
        """Adapter: the doorbell names slot k (whole: `_pack_slot` synchronised) as `version`."""
        word = doorbell_value(version, k)
        for bell in self.doorbells:
            bell.fill_(word)  # one aligned 8-byte store; the engine's lookup reads it with one load

    def _verified(self, slot: int, full: bool) -> list[dict[str, Any]]:
        """A verified push's one HTTP call per engine: the checksum of what it serves now."""
        if self.mode is SyncMode.ADAPTER:  # publishes the rung slot at once, then hashes it
            body: dict[str, Any] = {"slot": slot, "weight_version": None, "verify": True}
            return self._all("push", [body] * len(self.slots))
        return self._all("checksum", [{"full": full} if self.merges else {"slot": slot}] * len(self.words))

    def _digest(self, verify: bool, full: bool) -> str | None:
        """What the engines were given (read back from engine 0's memory: see the module docstring)."""
        if self.slots:
            assert self.packed is not None
            return self.packed(self.slots[0][(self.pushes - 1) % self.adapter_slots])
        if not verify:
            return None
        dst = self.targets[0]
        return checksum((name, dst[name]) for name in self.names[full])

    def close(self) -> None:
        self.decide_graphs, self.fused_decide = {}, None
        self._close_wakers()
        super().close()
