"""The fast path of weight sync over the weight-update group: `plan.py`'s plan and pipelined push behind
`WeightSender` (only kora's reference engine answers it: its `/kora/fast_sync/*` routes).

`path.with_fast_path(sender, cfg)` (TrainWorker.connect) wraps the backend's HTTP sender (`WeightSender`,
`MegatronWeightSender`) in a `FastWeightSender` where the fast path may apply — sync.fastPath (true), the
weight-update group (Disaggregated, or Colocate's distributedEngines), Merge or Adapter mode, kora's hf engine —
(colocated engines: `colocated.ColocatedFastSender`, the same steps in memory) and returns it unchanged
otherwise (SGLang engines, EngineMerge, a TP follower). Then (base.py's steps):

1. The first sync is the HTTP path's (Adapter: the base + the adapter; Merge: the merged model), checked end to
   end by the engines' checksums; the engines now hold the policy.
2. Right after it, ONE plan. The adapter parameters are laid end to end in one buffer
   (`adapter_pack.flatten_parameters`: the same parameter objects and values, the optimizer untouched); Merge:
   `plan.MergePlan` over the policy's `fast_merge_entries` (policy.py) and a `plan.PipelinedSender` (ring
   buffers; on CUDA the folds captured once); Adapter:
   `adapter_pack.AdapterPack` over `fast_adapter_specs` (one gather). Every engine gets the buckets' metadata (`POST
   /kora/fast_sync/plan`, kora_engine/lm/fast_routes.py). A policy the plan does not cover (MoE experts, TP > 1, a
   folded weight over sync.bufferSize, ...), an engine without the route (404: SGLang) or one refusing the plan
   keeps the job on the HTTP path; the report's `note` says why (and, when it worked, that the fast path is on).
3. Every later sync: `adapter_pack.FlatDelta` decides with the HTTP path's rule (push iff the max |Δadapter| over the
   trainer's group since the last push > sync.deltaSkipThreshold; collective: every rank calls `sync`); a push
   issues `POST /kora/fast_sync/push` to every engine from the clients' threads while the buckets are broadcast
   (Merge: bucket i+1 packed while bucket i is on the wire; Adapter: one gather, one broadcast per bucket); the
   engines answer after applying. No per-push planning, export, serialisation or HTTP call per bucket.

Checksums (`SyncReport.checksum`) keep the HTTP path's definition, `protocol.checksum` of every tensor pushed in
push order, so a fast push and an HTTP push of one policy report the same value. Adapter: every push, from one
pass over the packed adapter (`protocol.PackedChecksum`, one host read). Merge: on verified pushes only (else
None): the trainer refills the buckets after the push and hashes them tensor by tensor, a pass over the whole
model, too dear for every push. Verified pushes — the first fast push and every `VERIFY_EVERY`-th after it — also
ask every engine for the checksum of what it applied and fail the sync on a difference, as the HTTP path does on
every push: the layout is fixed at plan time, so a wrong layout shows on the first push, and hashing on the
engine at every push would put a pass over the pushed bytes on each push's critical path. `ms` leaves hashing
out, as on the HTTP path.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kora_trainer.config import SyncMode
from kora_trainer.sync.fast.adapter_pack import AdapterPack, FlatDelta, flatten_parameters
from kora_trainer.sync.fast.base import FastSender
from kora_trainer.sync.fast.plan import MergePlan, PipelinedSender
from kora_trainer.sync.sender import POLICY_ADAPTER, RunningChecksum, SyncReport
from kora_trainer.sync.transport import GROUP_NAME, DistributedTransport, SyncError, wait_all
from kora_trainer.wire.engine_client import EngineError
from kora_trainer.wire.protocol import Assembler, PackedChecksum


class FastWeightSender(FastSender):
    """`Sender` (collective, a `SyncReport` per call) over the weight-update group after the HTTP path's first push;
    see the module docstring."""

    transport_type: type = DistributedTransport

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.plan: MergePlan | None = None
        self.sender: PipelinedSender | None = None
        self.pack: AdapterPack | None = None
        self.packed: PackedChecksum | None = None

    # ---- the plan, once -----------------------------------------------------------------------------------

    def _make_plan(self) -> MergePlan | AdapterPack:
        """The layout of every push (raises for what the fast path does not cover)."""
        if self.mode is SyncMode.MERGE:
            return MergePlan(self.policy.fast_merge_entries(), self.cap)
        return AdapterPack(self.policy.fast_adapter_params(), self.policy.fast_adapter_specs(), self.cap)

    def _plan(self) -> str:
        if self.transport.group.device.type == "cuda":  # nothing in flight while the plan captures its folds
            torch.cuda.synchronize()
        try:
            self._make_plan()  # what the plan cannot cover raises here, before the parameters are touched
            flat = flatten_parameters(self.policy.fast_adapter_params())
            plan = self._make_plan()  # over the flat parameters
            extra: dict[str, Any] = {"slots": 2}
            if isinstance(plan, MergePlan):
                self.plan, self.sender = plan, PipelinedSender(plan, self.transport.group)
                self.nbytes, self.nbuckets = plan.nbytes, len(plan.buckets)
            else:
                self.pack = plan
                self.packed = PackedChecksum([(n, plan.dtype, s) for n, s in zip(plan.names, plan.shapes, strict=True)],
                                             plan.out.device)
                self.nbytes, self.nbuckets = plan.out.numel() * plan.out.element_size(), len(plan.buckets)
                extra = {"slots": self.adapter_slots, "lora_name": POLICY_ADAPTER,
                         "config_dict": self.adapter_config}
        except (NotImplementedError, ValueError, KeyError) as e:
            return self._off(f"the policy: {e}")
        clients = self.transport.clients
        futs = [c.submit(c.fast_sync_plan, str(self.mode), plan.metadata, GROUP_NAME, **extra) for c in clients]
        refused = []
        for c, f in zip(clients, futs, strict=True):
            try:
                f.result(timeout=self.transport.timeout_s)
            except EngineError as e:
                refused.append(f"{c.base_url} has no fast-sync route (HTTP 404: not kora's hf engine)"
                               if e.status == 404 else f"{c.base_url} refused the plan: {e.message}")
            except TimeoutError:
                refused.append(f"{c.base_url} did not answer the plan in {self.transport.timeout_s:.0f} s")
        if refused:
            self.plan = self.sender = self.pack = None
            return self._off("; ".join(refused))
        self.flat, self.delta = flat, FlatDelta(flat)
        self.delta.mark_pushed(flat)  # what the HTTP push just sent
        self.active = True
        return (f"fast path on: {self.nbuckets} bucket(s), {self.nbytes} B per push, planned on {len(clients)} "
                f"engine(s)")

    # ---- a push -------------------------------------------------------------------------------------------

    def _push(self, version: int) -> SyncReport:
        assert self.flat is not None and self.delta is not None
        t0 = time.perf_counter()
        kind, mode = self.transport.kind, str(self.mode)
        push, delta = self.delta.should_push(self.flat, self.threshold, self.trainer_group)
        if not push:
            return SyncReport.skip(mode, kind, self.engine_version, delta, path="fast")
        verify = self.verify and self.pushes % self.verify_every == 0
        clients = self.transport.clients
        futs = [c.submit(c.fast_sync_push, str(version), GROUP_NAME, verify) for c in clients]
        if self.sender is not None:
            self.sender.push()
        else:
            assert self.pack is not None
            self.pack.push(self.transport.group)
        results = wait_all(futs, self.transport.timeout_s)
        if self.flat.is_cuda:
            torch.cuda.synchronize(self.flat.device)
        self.delta.mark_pushed(self.flat)
        ms = (time.perf_counter() - t0) * 1000
        self.pushes += 1
        self.engine_version = version
        digest = self._checksum(verify)
        if verify:
            bad = [f"{c.base_url}: {r.get('checksum')}" for c, r in zip(clients, results, strict=True)
                   if r.get("checksum") != digest]
            if bad:
                raise SyncError(f"an engine applied different bytes than were sent ({bad[0]} != {digest})")
        return SyncReport(mode=mode, transport=kind, pushed=True, bytes=self.nbytes, ms=round(ms, 2),
                          adapter_version=version, checksum=digest, buckets=self.nbuckets, max_delta=delta,
                          what="full" if self.sender is not None else "adapter", path="fast")

    def _checksum(self, verify: bool) -> str | None:
        """`protocol.checksum` of what was pushed (Merge: verified pushes only; see the module docstring)."""
        if self.pack is not None:
            assert self.packed is not None
            return self.packed(self.pack.out.view(torch.uint8))
        if not verify:
            return None
        assert self.plan is not None and self.sender is not None
        running, assembler = RunningChecksum(), Assembler(self.sender.device)
        for i, meta in enumerate(self.plan.metadata):  # the fill is deterministic: the bytes just sent, again
            for name, t in assembler.feed(meta, self.sender.fill(i)):
                running.add(name, t)
        return running.hexdigest()
