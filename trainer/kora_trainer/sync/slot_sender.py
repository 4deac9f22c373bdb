"""Selective sync for multi-LoRA: the base once, then each adapter that stepped under its own name.

Multi-adapter jobs are Adapter mode (a merged model cannot hold several adapters). `push_base` sends the frozen
base once; `publish(name, version, config)` — called while that adapter's slot is active (lora/slots.py), so
the model's LoRA views read its factors — pushes only its tensors, bucketed as Adapter mode always is, over the
weight-update group (`load_lora_adapter_from_distributed`: the engine publishes a new immutable version under the
name, tagged `version`, while the other adapters keep generating) or in memory (unload + load of that name;
the rollout manager tags those rollouts with the version it knows). Adapters that did not step are not pushed,
so their versions stay where they were. Delta-skip is per adapter (its own tracker), decided over every rank.

`retire(name)` comes after the rollout manager aborted the adapter's requests by their exact rids
(AdapterRolloutWorker.abort_adapter: every build); where the build also aborts by request-id prefix `<name>::`
(sglang-miles #30912's spelling, and kora's reference engine) it sends that too, waits (bounded) until no engine
holds one where the engine can say (the reference engine's GET /kora/state), and unloads it. A stock build's unload
itself waits for the adapter's requests still running (config/sglang_builds.py's docstring).
"""

from __future__ import annotations

import time
from typing import Any

from kora_trainer.sync.delta import DeltaTracker, should_push
from kora_trainer.sync.sender import RunningChecksum, SyncReport, WeightSender
from kora_trainer.sync.transport import PhaseClock
from kora_trainer.wire.engine_client import EngineClient, EngineError
from kora_trainer.wire.gdn_lora import to_sglang_config

RETIRE_WAIT_S = 30.0


def rid_prefix(name: str) -> str:
    """Every request of adapter `name` has the id `<name>::<uuid>`."""
    return f"{name}::"


class SlotSender(WeightSender):
    trackers: dict[str, DeltaTracker]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.trackers = {}

    @property
    def clients(self) -> list[EngineClient]:
        return list(self.transport.clients) if self.transport is not None else []

    def push_base(self) -> SyncReport:
        """The frozen base, once (adapters are kept out of it: every slot is off outside `active`)."""
        t0 = time.perf_counter()
        self.clock = PhaseClock()
        checksum = RunningChecksum()
        nbytes = nbuckets = 0
        if self.transport is not None:
            nbytes, nbuckets = self._push_weights(self.base_source(), 0, checksum, {})
        ms = (time.perf_counter() - t0 - checksum.seconds) * 1000
        return SyncReport(mode="Adapter", transport=self._transport_kind(), pushed=True, bytes=nbytes,
                          ms=round(ms, 2), adapter_version=0, buckets=nbuckets, what="base",
                          checksum=checksum.hexdigest() if self.transport is not None else None,
                          phases=dict(self.clock.ms))

    def publish(self, name: str, version: int, config: dict[str, Any]) -> SyncReport:
        """Push adapter `name` at `version` (or skip it, collectively). Its slot must be active."""
        t0 = time.perf_counter()
        self.clock = PhaseClock()  # this publish's phases, not the last one's
        tracker = self.trackers.setdefault(name, DeltaTracker())
        adapter = self.adapter_named()  # this rank's tensors of the active slot (its shards on megatron)
        first = not tracker.ever_pushed
        push, delta = should_push(tracker, adapter, self.threshold, self.trainer_group)
        if not push:
            return SyncReport.skip("Adapter", self._transport_kind(), version, delta)
        checksum = RunningChecksum()
        nbytes = nbuckets = 0
        if self.transport is not None:
            # under the engines' names, as the single-adapter push (SGLang's fused GDN modules: wire/gdn_lora.py)
            self.adapter_name, self.adapter_config = name, to_sglang_config(config, self.gate_adapters)
            nbytes, nbuckets = self._push_adapter(self.served_adapter_source(), version, checksum)
        tracker.mark_pushed(adapter)
        ms = (time.perf_counter() - t0 - checksum.seconds) * 1000
        return SyncReport(mode="Adapter", transport=self._transport_kind(), pushed=True, bytes=nbytes,
                          ms=round(ms, 2), adapter_version=version, buckets=nbuckets, what="adapter",
                          max_delta=None if first else delta,
                          checksum=checksum.hexdigest() if self.transport is not None else None,
                          phases=dict(self.clock.ms))

    def retire(self, name: str, wait_s: float = RETIRE_WAIT_S) -> dict[str, Any]:
        """Abort its requests by prefix where the build can, wait for none in flight (bounded, where the engine
        reports it), unload. A build without the prefix abort is not sent it (it would abort nothing: the rid is no
        request's); the rollout manager has aborted each rid exactly before this."""
        t0 = time.monotonic()
        if self.build is None or self.build.abort_prefix:
            for c in self.clients:
                c.abort_request(rid_prefix(name), prefix=True)
        # only kora's reference engine can say what is still in flight (GET /kora/state); an SGLang build cannot, and
        # is not asked (a route it lacks): its unload itself waits for the adapter's requests to finish
        left = {c.base_url: self._wait_drained(c, name, t0 + wait_s) if self.build is None else None
                for c in self.clients}
        for c in self.clients:
            try:
                c.unload_lora_adapter(name)
            except EngineError as e:
                if "does not exist" not in e.message and "not loaded" not in e.message:
                    raise
        self.trackers.pop(name, None)
        self._loaded.discard(name)
        return {"in_flight_left": left, "ms": round((time.monotonic() - t0) * 1000, 1)}

    @staticmethod
    def _wait_drained(c: EngineClient, name: str, deadline: float) -> int | None:
        """Its requests still in flight on `c` when the wait ended (None: the engine cannot say, SGLang)."""
        prefix = rid_prefix(name)
        while True:
            try:
                held = int(c.kora_state().get("in_flight_by_rid_prefix", {}).get(prefix, 0))
            except EngineError:
                return None
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(0.02)  # polling an engine's counter, bounded by the deadline above
