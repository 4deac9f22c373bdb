"""The colocated fast path's sync modes as strategy objects (PEFT's LoraVariant habit): the sender's steps
(colocated.py) are one sequence, and each mode says what its plan asks of the engines, what of their memory it
maps, and what its push does — Merge folds into the engine's weights under its weight lock, Adapter packs a ring
slot and rings the doorbell, EngineMerge packs a ring slot (or lets the engine gather it) and asks the engine to fold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kora_trainer.config import SyncMode
from kora_trainer.sync.fast.adapter_pack import AdapterPack
from kora_trainer.sync.fast.colocated_merge import ColocatedMerge
from kora_trainer.sync.fast.handshake import Handshake, Laps, ask_all, engine_laps
from kora_trainer.sync.fast.plan import Entry, FoldEntry, PlainEntry
from kora_trainer.sync.fast.policy import PolicyPlan
from kora_trainer.sync.fast.ring import Ring, on_device, one_rank_runs
from kora_trainer.sync.sender import POLICY_ADAPTER
from kora_trainer.sync.transport import SyncError
from kora_trainer.wire.colocated_words import (
    ARG,
    DARG,
    DELTA,
    DONE,
    GATE,
    GRANT,
    PUSHED,
    REQ,
    SPENT,
    THRESH,
    WORK,
    float_word,
    now_us,
    word_float,
)
from kora_trainer.wire.fast_receive import doorbell_value
from kora_trainer.wire.protocol import checksum
from kora_trainer.wire.serialize import serialize_payload

Mapped = list[list[tuple[str, torch.Tensor]]]


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


@dataclass
class Context:
    """What a mode uses of the sender: its engines, the handshake, the push's clock and the HTTP path's settings."""

    mode: SyncMode
    transport: Any  # a ColocatedTransport: clients, timeout_s
    hand: Handshake
    clock: Laps
    adapter_slots: int
    trainer_group: Any
    adapter_config: dict[str, Any]
    lora: Any  # the job's lora section (EngineMerge: the HTTP path's lora_merge parameters)
    sync: Callable[[], None]  # the trainer's device synchronised (its flat adapter's)


class ColocatedMode:
    """One sync mode's part of a colocated push. The defaults are a mode without handshake or ring."""

    what = ""  # SyncReport.what of a push
    ring: Ring | None = None  # Adapter, EngineMerge: each engine's ring slots
    runs: tuple[torch.Tensor, int] | None = None  # one trainer rank: the slot's gather index as runs
    engine_gathers = False  # EngineMerge: the engines gather the slot and decide (`fold_on_engine`)
    scratch = 0  # Merge: weights the engine holds apart (fold, then copy)

    def __init__(self, ctx: Context):
        self.ctx = ctx

    # ---- the plan, once -----------------------------------------------------------------------------------------

    def make_plan(self, policy: PolicyPlan, cap: int) -> Any:
        """What a push writes (raises for what the colocated path does not cover)."""
        raise NotImplementedError

    def body(self, plan: Any, flat: torch.Tensor) -> dict[str, Any]:
        """The plan request every engine gets (`/kora/colocated/plan`)."""
        raise NotImplementedError

    def take(self, plan: Any, answers: list[dict[str, Any]], mapped: Mapped, device: torch.device) -> tuple[int, int]:
        """The engines' memory, mapped (raises ValueError / KeyError where it does not fit): (bytes, buckets)."""
        raise NotImplementedError

    def drop(self) -> None:
        """Forget what `take` mapped (it failed)."""

    def ready(self, answers: list[dict[str, Any]]) -> None:
        """The plan is in place (the engines' answers say what they do themselves)."""

    # ---- a push -------------------------------------------------------------------------------------------------

    def slot(self, pushes: int) -> int:
        """The ring slot push number `pushes` packs (-1: none)."""
        return -1

    def before_decide(self, n: int) -> None:
        """Request n, made before the delta decision is read."""

    def decide_failed(self, n: int) -> None:
        """The decision raised: undo `before_decide`."""

    def skipped(self, version: int, n: int) -> None:
        """A delta-skip of `version` (request n)."""

    def publish(self, version: int, n: int, slot: int) -> None:
        """The engines serve `version` from here on (request n, ring slot `slot`)."""
        raise NotImplementedError

    def verified(self, slot: int, full: bool) -> list[dict[str, Any]]:
        """A verified push's one HTTP call per engine: the checksum of what it serves now."""
        raise NotImplementedError

    def digest(self, pushes: int, verify: bool, full: bool) -> str | None:
        """What the engines were given (read back from engine 0's memory: colocated.py's module docstring)."""
        raise NotImplementedError

    def written(self, nbytes: int) -> int:
        """The bytes a push wrote."""
        return nbytes

    def arm(self, pushes: int) -> None:
        """The step's update is enqueued and push `pushes` follows."""

    def fold_on_engine(self, version: int, n: int, pushes: int, threshold: float) -> tuple[bool, float, int]:
        """`engine_gathers`: the push's decision, made by the engines (EngineMergeMode)."""
        raise NotImplementedError


class MergeMode(ColocatedMode):
    """Merge: the engine's parameters mapped; a push folds W + s·B·A straight into them under its weight lock."""

    what = "adapted"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.merges: list[ColocatedMerge] = []  # one per engine
        self.names: dict[bool, list[str]] = {}  # full -> what a push writes
        self.targets: list[dict[str, torch.Tensor]] = []  # each engine's parameters, mapped

    def make_plan(self, policy: PolicyPlan, cap: int) -> list[Entry]:
        return policy.fast_merge_entries()  # no buckets: sync.bufferSize does not bound a fold written in place

    def body(self, plan: Any, flat: torch.Tensor) -> dict[str, Any]:
        # the engine holds what megatron fuses (q;k;v, gate;up) apart: one buffer each, folded into at once
        fuse = [[n for n, _ in e.outs] for e in plan if isinstance(e, FoldEntry) and len(e.outs) > 1]
        self.names = {full: written_names(plan, full) for full in (True, False)}
        return {"mode": "Merge", "fuse": fuse, "lease_s": min(self.ctx.transport.timeout_s, 3600.0),
                "names": {"full": self.names[True], "adapted": self.names[False]}}

    def take(self, plan: Any, answers: list[dict[str, Any]], mapped: Mapped, device: torch.device) -> tuple[int, int]:
        self.ctx.hand.attach(answers, mapped)
        self.targets = [on_device(dict(m), device) for m in mapped]
        self.merges = [ColocatedMerge(plan, dst) for dst in self.targets]
        for merge in self.merges:
            merge.prepare(full=False)
        self.scratch = sum(m.scratch_entries for m in self.merges)
        return self.merges[0].nbytes, 1

    def drop(self) -> None:
        self.merges, self.targets = [], []

    def before_decide(self, n: int) -> None:
        self.ctx.hand.store(ARG, 0, REQ, n)  # the engines take their weight locks while the number is read

    def decide_failed(self, n: int) -> None:
        self.ctx.hand.store(DARG, 0, DONE, -n)  # the locks back before failing the sync

    def skipped(self, version: int, n: int) -> None:
        self.ctx.hand.store(DARG, 0, DONE, -n)  # the locks back, unused
        self.ctx.hand.acks(n, f"giving the weight lock back unused (delta-skip of version {version})")

    def publish(self, version: int, n: int, slot: int) -> None:
        """Request n was made before the delta decision; once every engine holds its weight lock, the fold
        writes the adapted weights straight into the mapped ones, then DONE (with the version) and the
        acknowledgements."""
        hand, clock = self.ctx.hand, self.ctx.clock
        try:
            hand.wait(GRANT, lambda v: v == n, f"did not grant its weight lock for push {n} (version {version})")
            clock.lap("lock")
            for merge in self.merges:
                merge.push(full=False)
            self.ctx.sync()
            clock.lap("write")
        except BaseException:
            hand.store(DARG, 0, DONE, -n)  # every engine's lock back before failing the sync
            raise
        hand.store(DARG, doorbell_value(version, 0), DONE, n)
        hand.acks(n, f"setting version {version} after the write")
        clock.lap("ack")

    def verified(self, slot: int, full: bool) -> list[dict[str, Any]]:
        return ask_all(self.ctx.transport, "checksum", [{"full": full}] * len(self.ctx.hand.words))

    def digest(self, pushes: int, verify: bool, full: bool) -> str | None:
        if not verify:
            return None
        dst = self.targets[0]
        return checksum((name, dst[name]) for name in self.names[full])

    def written(self, nbytes: int) -> int:
        return self.merges[0].adapted_bytes


class RingMode(ColocatedMode):
    """Adapter and EngineMerge: the HF-PEFT pairs packed by one gather into a ring of slots in each engine."""

    def make_plan(self, policy: PolicyPlan, cap: int) -> AdapterPack:
        return AdapterPack(policy.fast_adapter_params(), policy.fast_adapter_specs(), cap)

    def body(self, plan: Any, flat: torch.Tensor) -> dict[str, Any]:
        ctx = self.ctx
        self.runs = one_rank_runs(plan, flat, ctx.trainer_group, ctx.adapter_slots)
        return {"mode": str(ctx.mode), "metadata": plan.metadata, "slots": ctx.adapter_slots,
                "lora_name": POLICY_ADAPTER, "config_dict": ctx.adapter_config}

    def take(self, plan: Any, answers: list[dict[str, Any]], mapped: Mapped, device: torch.device) -> tuple[int, int]:
        ring = Ring(plan, self.ctx.adapter_slots)
        ring.take(mapped, device)
        self.ring = ring
        return ring.need, 1

    def drop(self) -> None:
        self.ring = None

    def slot(self, pushes: int) -> int:
        return pushes % self.ctx.adapter_slots

    def digest(self, pushes: int, verify: bool, full: bool) -> str | None:
        assert self.ring is not None
        return self.ring.digest((pushes - 1) % self.ctx.adapter_slots)


class AdapterMode(RingMode):
    """Adapter: a push packs ring slot k and stores (version, k) into each engine's doorbell."""

    what = "adapter"

    def publish(self, version: int, n: int, slot: int) -> None:
        assert self.ring is not None
        self.ring.ring(version, slot)
        self.ctx.clock.lap("ring")

    def verified(self, slot: int, full: bool) -> list[dict[str, Any]]:
        assert self.ring is not None  # publishes the rung slot at once, then hashes it
        body: dict[str, Any] = {"slot": slot, "weight_version": None, "verify": True}
        return ask_all(self.ctx.transport, "push", [body] * len(self.ring.slots))


class EngineMergeMode(RingMode):
    """EngineMerge: the engine folds ring slot k into its pristine base (the HTTP path's lora_merge) when asked
    through the handshake; with one trainer rank it maps the flat adapter too and gathers the slot itself."""

    what = "lora_pairs"

    def body(self, plan: Any, flat: torch.Tensor) -> dict[str, Any]:
        body = super().body(plan, flat)
        lora = self.ctx.lora  # the HTTP path's lora_merge parameters
        body.update(lora_alpha=lora.alpha, lora_rank=lora.rank, merge_fp32=True)
        if self.runs is not None:  # one context for the push: the engine maps the flat adapter
            starts, run = self.runs
            body["gather"] = {"payload": serialize_payload([("flat", flat), ("starts", starts)]),
                              "run": run, "numel": plan.out.numel(), "dtype": str(plan.dtype)}
        return body

    def take(self, plan: Any, answers: list[dict[str, Any]], mapped: Mapped, device: torch.device) -> tuple[int, int]:
        self.ctx.hand.attach(answers, mapped)
        return super().take(plan, answers, mapped, device)

    def ready(self, answers: list[dict[str, Any]]) -> None:
        self.engine_gathers = all(a.get("gathers") for a in answers)

    def publish(self, version: int, n: int, slot: int) -> None:
        if self.engine_gathers:  # folded in `fold_on_engine` already
            return
        asked = now_us()
        self.ctx.hand.store(ARG, doorbell_value(version, slot), REQ, n)
        self.engine_answered(n, f"folding ring slot {slot} as version {version}", asked)

    def verified(self, slot: int, full: bool) -> list[dict[str, Any]]:
        return ask_all(self.ctx.transport, "checksum", [{"slot": slot}] * len(self.ctx.hand.words))

    def arm(self, pushes: int) -> None:
        """With `gather`: ARM the next request with the slot it will name, so each engine's watcher holds its weight
        lock for it, has enqueued its gather and fold behind GATE (on a GPU; else warmed their launch) and is
        spinning when the request comes (wire/colocated_words.py). The step's update is made whole here, so the
        push's own synchronise finds the device idle."""
        if not self.engine_gathers:
            return
        self.ctx.sync()
        self.ctx.hand.arm(pushes % self.ctx.adapter_slots)  # `fold_on_engine`'s slot: no push in between

    def fold_on_engine(self, version: int, n: int, pushes: int, threshold: float) -> tuple[bool, float, int]:
        """With the plan's `gather`: the step's update whole on the device (synchronised), then request n — the
        engine gathers slot k from the flat adapter, folds it, decides against THRESH and on a skip folds the last
        push back in — and the ACK; the decision and the number are the engine's (PUSHED, DELTA)."""
        hand = self.ctx.hand
        slot = pushes % self.ctx.adapter_slots
        self.ctx.sync()
        self.ctx.clock.lap("sync")
        asked = now_us()
        word = float_word(threshold)
        for words in hand.words:
            words[GATE] = n  # first: an engine that prelaunched request n has its GPU waiting on this word
            words[THRESH] = word
        hand.store(ARG, doorbell_value(version, slot), REQ, n)
        self.engine_answered(n, f"gathering and folding ring slot {slot} as version {version}", asked)
        pushed = {words[PUSHED] == n for words in hand.words}
        if len(pushed) > 1:  # one adapter, one threshold, one record of the last push: never apart
            raise SyncError(f"colocated EngineMerge push {n}: the engines decided the delta-skip apart")
        return pushed.pop(), max(word_float(words[DELTA]) for words in hand.words), slot

    def engine_answered(self, n: int, what: str, asked: int) -> None:
        """Every engine's ACK n, then engine 0's account of the push (`engine`, `engine_spent`, the moments)."""
        hand, clock = self.ctx.hand, self.ctx.clock
        hand.acks(n, what)
        clock.lap("engine")
        w = hand.words[0]
        engine_laps(w, clock.laps, asked, now_us(), n)
        clock.laps["engine_spent"] = w[SPENT] / 1000
        if w[WORK]:
            clock.laps["engine_fold"] = w[WORK] / 1000


MODES: dict[SyncMode, type[ColocatedMode]] = {SyncMode.MERGE: MergeMode, SyncMode.ADAPTER: AdapterMode,
                                              SyncMode.ENGINE_MERGE: EngineMergeMode}
