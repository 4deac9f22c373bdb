"""Which path a job's weight sync takes: `with_fast_path(sender, cfg)` (TrainWorker.connect) returns production's
HTTP sender as it is, or wrapped in the fast path that only kora's reference engine answers (this package's
docstring): `distributed.FastWeightSender` over the weight-update group, `colocated.ColocatedFastSender` in memory.
"""

from __future__ import annotations

from kora_trainer.config import SyncMode, TrainerConfig
from kora_trainer.config.sections import Engine
from kora_trainer.sync.fast.colocated import ColocatedFastSender
from kora_trainer.sync.fast.distributed import FastWeightSender
from kora_trainer.sync.sender import Sender, WeightSender
from kora_trainer.sync.transport import ColocatedTransport, DistributedTransport


def fast_path_off(sender: WeightSender, cfg: TrainerConfig) -> str | None:
    """Why the fast path cannot apply to this job (None: it may; the plan decides)."""
    if not cfg.sync.fast_path:
        return "sync.fastPath is false"
    kind = type(sender.transport)
    modes = (SyncMode.MERGE, SyncMode.ADAPTER) + ((SyncMode.ENGINE_MERGE,) if kind is ColocatedTransport else ())
    if sender.mode not in modes:  # over the group, EngineMerge's pairs go by the HTTP path's buckets
        return f"{sender.mode} mode"
    if cfg.parallelism.tensor > 1:  # every TP rank must take part in a push; the fast plans are one rank's
        return "tensor parallelism (the trainer's fast path is TP 1)"
    if kind not in (DistributedTransport, ColocatedTransport):  # a TP follower, none
        return f"the {getattr(sender.transport, 'kind', 'missing')} transport"
    if cfg.rollout.engine != Engine.HF:
        return f"{cfg.rollout.engine} engines"
    if cfg.rollout.sglang_build is not None:  # the reference engine in a build's strict mode has no /kora/* routes
        return f"rollout.sglangBuild {cfg.rollout.sglang_build.value} (SGLang's routes only)"
    return None


def with_fast_path(sender: WeightSender, cfg: TrainerConfig) -> Sender:
    """`sender`, wrapped in a `FastWeightSender` (over the weight-update group) or a `ColocatedFastSender` (in
    memory) where the fast path may apply."""
    if fast_path_off(sender, cfg) is not None:
        return sender
    # Adapter mode: a request keeps the adapter object it was admitted with; its ring slot must outlive the
    # pushes made while it runs (async: up to maxStaleness steps ahead)
    ahead = cfg.deployment.max_staleness if cfg.deployment.async_ else 0
    if type(sender.transport) is ColocatedTransport:
        # EngineMerge: each push's pairs are folded before its call returns, so one slot would serve; two let the
        # next push's delta decision read the last pushed pairs from the other slot (ring.Decision.capture)
        return ColocatedFastSender(sender, adapter_slots=2 if sender.mode is SyncMode.ENGINE_MERGE else 3 + ahead)
    return FastWeightSender(sender, adapter_slots=3 + ahead)
