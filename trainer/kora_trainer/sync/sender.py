"""The trainer's half of weight sync: push the policy being trained to the rollout engines.

Three modes (SPEC.md "Weight sync"):
- Merge: fold each adapter into its base weight (W + (alpha/r)·B·A in fp32, rounded once) and push
  the whole model under HF names, in buckets ≤ sync.bufferSize. Engines need no LoRA support.
- Adapter: push the base once (adapter tensors kept out), then only the adapter each step, served
  under the fixed name `kora-policy` (generate requests carry `lora_path=kora-policy`).
- EngineMerge: push raw lora_A/lora_B pairs (a pair never split across buckets); the engine folds
  them into a pristine copy of its base (`weight_update_mode: "lora_merge"`).

Delta-skip (`delta.py`): when no adapter tensor moved more than sync.deltaSkipThreshold on any trainer
rank since the last push, nothing is pushed. SPEC names it for Adapter mode; it holds for the other
two as well (the merged model and the A/B pairs are functions of the adapter alone, the base is
frozen), so it is applied in every mode. The first sync always pushes.

Every rank of the trainer's group calls `sync()` each step (the skip decision is collective); only
rank 0 holds a transport and talks to the engines. Where the sources are themselves collective (megatron
tensor parallelism: every TP rank gathers shards while rank 0's buckets are made), the other ranks of that
group hold a `follower` transport: they run the same push — plan, sources, order — and send nothing.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from kora_trainer.config import SyncMode, TrainerConfig
from kora_trainer.config.engine_lora_limits import engine_lora_limits
from kora_trainer.config.sections import POLICY_ADAPTER
from kora_trainer.config.sglang_builds import effective_build, plan_for
from kora_trainer.lora import adapter_tensors, peft_config_dict
from kora_trainer.sync.delta import DeltaTracker, should_push
from kora_trainer.sync.sources import Source, adapter_source, base_source, merged_source, served_adapter_source
from kora_trainer.sync.transport import ColocatedTransport, DistributedTransport, PhaseClock, SyncError
from kora_trainer.wire.engine_client import EngineClient, EngineError, applied_checksum
from kora_trainer.wire.gdn_lora import to_sglang_config
from kora_trainer.wire.group import WeightUpdateGroup
from kora_trainer.wire.protocol import FLAT, Bucket, plan_buckets, tensor_digest
from kora_trainer.wire.protocol import checksum as protocol_checksum

Named = tuple[str, torch.Tensor]
__all__ = ["POLICY_ADAPTER", "Sender", "SyncReport", "WeightSender"]


@dataclass
class SyncReport:
    """One sync, as the trainer's worker returns it through Ray and the recorder writes it (events, /status)."""

    mode: str  # Merge | Adapter | EngineMerge
    transport: str  # distributed | colocated | none (a rank other than 0) | follower (`follower`)
    pushed: bool
    bytes: int  # bytes handed to the engines this sync (once, not per engine)
    ms: float  # wall time of the push (fold + transfer + engines' apply), checksum hashing excluded
    adapter_version: int  # the policy version the engines serve after this sync
    checksum: str | None  # protocol.checksum of every tensor pushed, in push order
    buckets: int = 0
    max_delta: float | None = None  # the group's max |Δadapter| since the last push (None on the first)
    what: str = ""  # full | base+adapter | adapter | lora_pairs | skipped
    path: str = "http"  # http (the engine routes, per bucket) | fast (sync/fast/: planned once)
    note: str = ""  # set once, where the path was decided: the fast path planned, or why it is not used
    # where the push's time went, in ms (the colocated fast path: sync/fast/colocated.py names the parts); a
    # verified push's extra checksum call is `verify_ms` here, outside `ms`: the engines serve the push before it
    phases: dict[str, float] = field(default_factory=dict)

    @classmethod
    def skip(cls, mode: str, transport: str, version: int, max_delta: float | None, path: str = "http") -> SyncReport:
        """Delta-skip: nothing moved past the threshold, the engines keep serving `version`."""
        return cls(mode=mode, transport=transport, pushed=False, bytes=0, ms=0.0, adapter_version=version,
                   checksum=None, max_delta=max_delta, what="skipped", path=path)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

class Sender(Protocol):
    """A weight sender as the trainer's worker (orchestration/workers.py) and the backends use it: production's
    `WeightSender` (and a backend's subclass of it) and the fenced fast path's wrappers (sync/fast/) alike. Every
    rank of the trainer's group calls `sync` each step (collective: the skip decision spans the group)."""

    transport: Any  # DistributedTransport | ColocatedTransport | a follower (`follower`) | None (no engine here)
    engine_version: int  # the policy version the engines serve

    def arm(self) -> None:
        """The step's update is enqueued and a push follows (a sender whose engines get ready for it tells them)."""
        ...

    def sync(self, version: int) -> SyncReport:
        """Push policy `version` (or skip it, collectively): what happened, as the recorder writes it."""
        ...

    def close(self) -> None: ...


class RunningChecksum:
    """protocol.checksum computed one tensor at a time (no list of every pushed tensor kept alive)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.seconds = 0.0

    def add(self, name: str, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self._h.update(tensor_digest(name, t))
        self.seconds += time.perf_counter() - t0

    def timed(self, fn: Any) -> Any:
        """Run a hashing job (the sender's side of an engine's checksum) on this object's clock."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds += time.perf_counter() - t0

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:16]


def colocated_buckets(groups: Sequence[Sequence[Named]], cap: int) -> list[list[str]]:
    """Groups packed greedily into name lists of ≤ cap bytes, never splitting a tensor: the in-memory
    routes take whole tensors. A single group larger than the cap travels alone."""
    out: list[list[str]] = [[]]
    size = 0
    for g in groups:
        n = sum(t.numel() * t.element_size() for _, t in g)
        if out[-1] and size + n > cap:
            out.append([])
            size = 0
        out[-1].extend(name for name, _ in g)
        size += n
    return [b for b in out if b]


class _Follow:
    """Sends nothing; every engine 'answers' nothing (so the checks pass): see `follower`."""

    kind = "follower"

    def send(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return []

    def send_tensors(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        pass


class _FollowDistributed(_Follow, DistributedTransport):
    def __init__(self) -> None:  # no clients, no group: nothing leaves this rank
        self.clients, self.timeout_s = [], 0.0


class _FollowColocated(_Follow, ColocatedTransport):
    def __init__(self) -> None:
        self.clients, self.timeout_s = [], 0.0


def follower(kind: str) -> DistributedTransport | ColocatedTransport:
    """The transport of a trainer rank that must take part in the push of the rank holding a transport of
    `kind` ("distributed" / "colocated") without talking to the engines: with it `WeightSender.sync` makes the
    same buckets from the same sources in the same order (their collectives match rank 0's) and sends nothing."""
    if kind == DistributedTransport.kind:
        return _FollowDistributed()
    if kind == ColocatedTransport.kind:
        return _FollowColocated()
    raise ValueError(f"no follower for a {kind!r} transport")


def _completed(bucket: Bucket) -> list[str]:
    """Names whose last byte is in this bucket (a split tensor counts where it completes)."""
    done = []
    for p in bucket.pieces:
        if p.end == p.tensor_nbytes:
            done.append(p.name)
    return done


class WeightSender:
    def __init__(self, model: nn.Module, cfg: TrainerConfig,
                 transport: DistributedTransport | ColocatedTransport | None,
                 trainer_group: WeightUpdateGroup | None = None, verify: bool = True):
        self.model, self.cfg = model, cfg
        self.mode = cfg.lora.effective_sync_mode
        self.transport = transport
        self.trainer_group = trainer_group
        self.cap = int(cfg.sync.buffer_size)
        self.threshold = cfg.sync.delta_skip_threshold
        self.verify = verify
        self.tracker = DeltaTracker()
        self.engine_version = 0  # the policy version the engines serve (0: the checkpoint they loaded)
        self.how: ModePush = MODE_PUSHES[self.mode]()  # what a push of this mode sends (the strategies below)
        self._loaded: set[str] = set()  # adapter names this sender has loaded on the engines (colocated)
        self.adapter_name = POLICY_ADAPTER  # multi-LoRA (sync/slot_sender.py) pushes each adapter under its own
        self.gate_adapters = engine_lora_limits().gdn_gate_adapters  # the build hosts GDN b/a adapters
        self.adapter_config = self.make_adapter_config()
        # a named SGLang build (config/sglang_builds.py): only its routes and fields, SGLang's per-tensor form
        self.build = effective_build(cfg)
        # in-memory pushes as one flattened bucket per call where the engine reads it (kora's engine, 0.5.17)
        self.flat = self.build is None or self.build.flat_in_memory
        self.clock = PhaseClock()  # the HTTP path's phases of the push under way (SyncReport.phases)

    # ---- what the policy is made of (the torch backend's HF model; backends/megatron/sync.py overrides) ----

    def make_adapter_config(self) -> dict[str, Any]:
        """The pushed adapter's config: target_modules under the engines' names (SGLang's fused GDN modules)."""
        return to_sglang_config(peft_config_dict(self.model, self.cfg.lora, self.cfg.model.path), self.gate_adapters)

    def adapter_named(self) -> list[Named]:
        """This rank's adapter tensors (live), for the delta-skip decision."""
        return adapter_tensors(self.model)

    def merged_source(self) -> Source:
        return merged_source(self.model)

    def base_source(self) -> Source:
        return base_source(self.model)

    def adapter_source(self) -> Source:
        return adapter_source(self.model)

    def served_adapter_source(self) -> Source:
        """Adapter mode's pushes: the adapter as the engines' LoRA loader names it (sources.served_adapter_source)."""
        return served_adapter_source(self.model, self.gate_adapters)

    # ---- the one entry point ------------------------------------------------------------------

    def arm(self) -> None:
        """The step's update is enqueued and a push follows: a sender whose engines can get ready for it tells
        them now (the colocated fast path, sync/fast/colocated.py); this one has nothing to do."""

    def sync(self, version: int) -> SyncReport:
        """Push policy `version` (or skip it, collectively). Call on every trainer rank."""
        t0 = time.perf_counter()
        self.clock = PhaseClock()
        adapter = self.adapter_named()
        first = not self.tracker.ever_pushed
        push, delta = should_push(self.tracker, adapter, self.threshold, self.trainer_group)
        self.clock.add("decide_ms", time.perf_counter() - t0)
        if not push:
            return SyncReport.skip(str(self.mode), self._transport_kind(), self.engine_version, delta)
        checksum = RunningChecksum()
        nbytes, nbuckets, what = 0, 0, ""
        if self.transport is not None:
            nbytes, nbuckets, what = self._push(version, checksum)
        t1 = time.perf_counter()
        self.tracker.mark_pushed(adapter)
        self.clock.add("track_ms", time.perf_counter() - t1)
        self.engine_version = version
        ms = (time.perf_counter() - t0 - checksum.seconds) * 1000
        return SyncReport(mode=str(self.mode), transport=self._transport_kind(), pushed=True, bytes=nbytes,
                          ms=round(ms, 2), adapter_version=version,
                          checksum=checksum.hexdigest() if self.transport is not None else None, buckets=nbuckets,
                          max_delta=None if first else delta, what=what, note=self._route_note() if first else "",
                          phases=dict(self.clock.ms))

    def _route_note(self) -> str:
        """The named build's row of config/sglang_builds.py (which route carries the policy), for the sync line."""
        plan = plan_for(self.cfg) if self.transport is not None else None
        return plan.note if plan is not None else ""

    def _transport_kind(self) -> str:
        return self.transport.kind if self.transport is not None else "none"

    def _push(self, version: int, checksum: RunningChecksum) -> tuple[int, int, str]:
        return self.how.push(self, version, checksum)

    # ---- full weights / lora pairs through the weight routes ------------------------------------

    def _push_weights(self, src: Source, version: int, checksum: RunningChecksum,
                      extra: dict[str, Any]) -> tuple[int, int]:
        # Only the last bucket carries the new version: a request the engine serves between two buckets runs on
        # half-updated weights and must not be tagged as the new policy (it keeps the old tag, a lag, and its
        # log-probs are still the ones it sampled with, which is what the importance ratio needs).
        def tag(i: int, n: int) -> str | None:
            return str(version) if i == n - 1 else None

        if isinstance(self.transport, DistributedTransport) and self.build is not None:
            return self._push_weights_per_tensor(src, version, checksum, extra)
        if isinstance(self.transport, DistributedTransport):
            buckets = plan_buckets(src.groups, self.cap)
            for i, bucket in enumerate(buckets):
                tensors = src.get(list(dict.fromkeys(p.name for p in bucket.pieces)))
                wv = tag(i, len(buckets))

                def call(c: EngineClient, meta: dict[str, list[Any]], wv: str | None = wv) -> dict[str, Any]:
                    return c.update_weights_from_distributed(meta, load_format=FLAT, weight_version=wv, **extra)

                results = self.transport.send(bucket, tensors, call)
                meta = bucket.metadata()
                self._check(results, checksum, lambda meta=meta, tensors=tensors: applied_checksum(meta, tensors))
                for name in _completed(bucket):
                    checksum.add(name, tensors[name])
            return sum(b.nbytes for b in buckets), len(buckets)
        transport = self.transport
        assert isinstance(transport, ColocatedTransport)

        def send_ipc(named: list[tuple[str, torch.Tensor]], wv: str | None) -> None:
            def call_ipc(c: EngineClient, payload: str, fmt: str | None) -> dict[str, Any]:
                return c.update_weights_from_tensor(payload, load_format=fmt, weight_version=wv, **extra)

            results = transport.send(named, call_ipc, flat=self.flat, clock=self.clock)
            self._check(results, checksum, lambda: protocol_checksum(named))

        return self._push_name_buckets(src, version, checksum, send_ipc)

    def _push_name_buckets(self, src: Source, version: int, checksum: RunningChecksum,
                           send: Callable[[list[tuple[str, torch.Tensor]], str | None], None]) -> tuple[int, int]:
        """Whole tensors in buckets of up to the cap (a tensor is never split, so a bucket holds at least one), each
        handed to `send` with the version on the last bucket only (see _push_weights); (bytes, buckets)."""
        name_buckets = colocated_buckets(src.groups, self.cap)
        total = 0
        for i, names in enumerate(name_buckets):
            t0 = time.perf_counter()
            tensors = src.get(names)  # Merge: the bucket's folds
            named = [(n, tensors[n]) for n in names]
            self.clock.add("gather_ms", time.perf_counter() - t0)
            send(named, str(version) if i == len(name_buckets) - 1 else None)
            for n, t in named:
                checksum.add(n, t)
                total += t.numel() * t.element_size()
        return total, len(name_buckets)

    def _push_weights_per_tensor(self, src: Source, version: int, checksum: RunningChecksum,
                                 extra: dict[str, Any]) -> tuple[int, int]:
        """An SGLang build's /update_weights_from_distributed: whole tensors (a tensor is never split, so a bucket
        holds at least one), each broadcast on its own (load_format null), the version on the last bucket."""
        transport = self.transport
        assert isinstance(transport, DistributedTransport)

        def send(named: list[tuple[str, torch.Tensor]], wv: str | None) -> None:
            def call(c: EngineClient, meta: dict[str, list[Any]]) -> dict[str, Any]:
                return c.update_weights_from_distributed(meta, load_format=None, weight_version=wv, **extra)

            transport.send_tensors(named, call)  # SGLang reports no checksum: nothing to compare

        return self._push_name_buckets(src, version, checksum, send)

    # ---- the adapter through the LoRA routes ------------------------------------------------------

    def _push_adapter(self, src: Source, version: int, checksum: RunningChecksum) -> tuple[int, int]:
        """The adapter: kora's bucketed route (the reference engine), a build's route over the group
        (sglang-miles), or in memory (colocated; a stock build's engine on this node)."""
        t0 = time.perf_counter()
        tensors = src.get(src.names)
        named = [(n, tensors[n]) for n in src.names]
        self.clock.add("gather_ms", time.perf_counter() - t0)
        distributed = isinstance(self.transport, DistributedTransport)
        if distributed and self.build is None:
            nbytes, nbuckets = self._adapter_buckets(src, tensors, named, str(version), checksum)
        elif distributed and self.build is not None and self.build.adapter_over_group:
            nbytes, nbuckets = self._adapter_over_group(named, str(version)), 1
        else:
            nbytes, nbuckets = self._adapter_in_memory(named, str(version), checksum), 1
        for n, t in named:
            checksum.add(n, t)
        return nbytes, nbuckets

    def _adapter_buckets(self, src: Source, tensors: dict[str, torch.Tensor], named: list[Named], wv: str,
                         checksum: RunningChecksum) -> tuple[int, int]:
        """kora's /load_lora_adapter_from_distributed: bucketed, upserted with its version after the last bucket."""
        assert isinstance(self.transport, DistributedTransport)
        config, name = self.adapter_config, self.adapter_name
        buckets = plan_buckets(src.groups, self.cap)
        results: list[dict[str, Any]] = []
        nb = len(buckets)
        for i, bucket in enumerate(buckets):
            def call(c: EngineClient, meta: dict[str, list[Any]], i: int = i) -> dict[str, Any]:
                return c.load_lora_adapter_from_distributed(name, config, meta, bucket_index=i,
                                                            num_buckets=nb, load_format=FLAT, weight_version=wv)

            results = self.transport.send(bucket, tensors, call)
        self._check(results, checksum, lambda: protocol_checksum(named))  # the engine hashes the whole adapter
        return sum(b.nbytes for b in buckets), len(buckets)

    def _adapter_over_group(self, named: list[Named], wv: str) -> int:
        """sglang-miles' route: the whole adapter in one call (upsert), one broadcast per tensor."""
        assert isinstance(self.transport, DistributedTransport)
        config, name = self.adapter_config, self.adapter_name

        def over_group(c: EngineClient, meta: dict[str, list[Any]]) -> dict[str, Any]:
            return c.load_lora_adapter_over_group(name, config, meta, upsert=True)

        self.transport.send_tensors(named, over_group)
        if name == POLICY_ADAPTER:  # the build's adapter route takes no version: label it after the load
            for c in self.transport.clients:
                c.update_weight_version(wv)
        return sum(t.numel() * t.element_size() for _, t in named)

    def _adapter_in_memory(self, named: list[Named], wv: str, checksum: RunningChecksum) -> int:
        """/load_lora_adapter_from_tensors: a colocated engine, or (a build without an adapter route over the
        group) an engine on this node, which config/sglang_builds.same_node_problem checked at start."""
        hand = self.transport if isinstance(self.transport, ColocatedTransport) else \
            ColocatedTransport(self.transport.clients if self.transport is not None else [])
        name = self.adapter_name
        results = hand.send(named, self._replace_adapter(name, self.adapter_config, wv), as_dict=True, flat=self.flat,
                            clock=self.clock)
        self._check(results, checksum, lambda: protocol_checksum(named))
        self._loaded.add(name)
        return sum(t.numel() * t.element_size() for _, t in named)

    def _replace_adapter(self, name: str, config: dict[str, Any], wv: str) -> Any:
        # SGLang refuses to load a name that is loaded: replacing = unload, then load. The first push only loads
        # (an unload of a name the engine never had is a 400 in SGLang's access log); should the engine still
        # hold the name from an earlier trainer (a restart), its refusal says so and the name is replaced.
        first = name not in self._loaded
        clock = self.clock

        def load(c: EngineClient, payload: str, fmt: str | None) -> dict[str, Any]:
            def load_once() -> dict[str, Any]:
                return clock.timed("load_ms", lambda: c.load_lora_adapter_from_tensors(name, config, payload,
                                                                                       load_format=fmt))

            if not first:
                clock.timed("unload_ms", lambda: c.unload_lora_adapter(name))
            try:
                return load_once()
            except EngineError as e:
                if not first or "already" not in e.message:
                    raise
            c.unload_lora_adapter(name)
            return load_once()

        def replace_adapter(c: EngineClient, payload: str, fmt: str | None) -> dict[str, Any]:
            out = load(c, payload, fmt)
            # SGLang's tensor route takes no version: label the new adapter's rollouts ourselves, after
            # the load (a request in between shows the older version: a lag, never a false "current").
            # The engine's one version serves one adapter only: multi-LoRA tags its rollouts itself.
            if name == POLICY_ADAPTER:
                clock.timed("version_ms", lambda: c.update_weight_version(wv))
            return out

        return replace_adapter

    def _check(self, results: list[dict[str, Any]], checksum: RunningChecksum, expected: Any) -> None:
        """Each engine's reported checksum must equal what was sent (engines that report none pass).
        Hashing time is kept out of the reported ms (it is verification, not transfer)."""
        if not self.verify:
            return
        got = [r.get("checksum") for r in results if isinstance(r, dict) and r.get("checksum")]
        if got:
            want = checksum.timed(expected)
            bad = [g for g in got if g != want]
            if bad:
                raise SyncError(f"an engine applied different bytes than were sent (checksum {bad[0]} != {want})")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


# ---- the modes (PEFT's LoraVariant habit: one strategy object per mode, the sender's steps call it) -------------

class ModePush:
    """One sync mode's push through production's routes: (bytes, buckets, SyncReport.what)."""

    def push(self, s: WeightSender, version: int, checksum: RunningChecksum) -> tuple[int, int, str]:
        raise NotImplementedError


class MergePush(ModePush):
    """Merge: the model, adapters folded in, under HF names through the weight routes: the whole model first, then
    only the weights a fold changes. The rest is the frozen base, which nothing overwrites on the engine (kora never
    releases an engine's weight memory), so pushing it again would move most of the model's bytes for nothing
    (docs/sglang_builds.md, the 4B table)."""

    def __init__(self) -> None:
        self.pushed = False

    def push(self, s: WeightSender, version: int, checksum: RunningChecksum) -> tuple[int, int, str]:
        src = s.merged_source()
        what = "full"
        if self.pushed and src.adapted is not None:
            src, what = src.only_adapted(), "adapted"
        n, b = s._push_weights(src, version, checksum, {})
        self.pushed = True
        return n, b, what


class EngineMergePush(ModePush):
    """EngineMerge: the raw lora_A/lora_B pairs through the weight routes; the engine folds them into a pristine
    copy of its base (`weight_update_mode: "lora_merge"`)."""

    def push(self, s: WeightSender, version: int, checksum: RunningChecksum) -> tuple[int, int, str]:
        lora = s.cfg.lora
        extra = {"weight_update_mode": "lora_merge", "lora_alpha": lora.alpha, "lora_rank": lora.rank,
                 "merge_fp32": True}
        n, b = s._push_weights(s.adapter_source(), version, checksum, extra)
        return n, b, "lora_pairs"


class AdapterPush(ModePush):
    """Adapter: the frozen base once (adapter tensors kept out), then only the adapter through the LoRA routes."""

    def __init__(self) -> None:
        self.base_pushed = False

    def push(self, s: WeightSender, version: int, checksum: RunningChecksum) -> tuple[int, int, str]:
        what = "adapter"
        n0 = b0 = 0
        if not self.base_pushed:
            n0, b0 = s._push_weights(s.base_source(), version, checksum, {})
            self.base_pushed = True
            what = "base+adapter"
        n, b = s._push_adapter(s.served_adapter_source(), version, checksum)
        return n0 + n, b0 + b, what


MODE_PUSHES: dict[SyncMode, type[ModePush]] = {SyncMode.MERGE: MergePush, SyncMode.ADAPTER: AdapterPush,
                                               SyncMode.ENGINE_MERGE: EngineMergePush}
