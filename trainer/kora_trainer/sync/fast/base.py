"""The steps both fast senders share (`distributed.FastWeightSender`, `colocated.ColocatedFastSender`): the HTTP
path's first push (production's `WeightSender`, checked end to end by the engines' checksums), then ONE plan, then
every later push on the fast path — or the HTTP path kept, with the reason printed, where the plan cannot cover the
policy or an engine has no route (404: SGLang). See distributed.py's and colocated.py's module docstrings.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kora_trainer.sync.fast.adapter_pack import FlatDelta
from kora_trainer.sync.fast.policy import PolicyPlan, policy_plan
from kora_trainer.sync.sender import SyncReport, WeightSender

log = logging.getLogger("kora.sync")

VERIFY_EVERY = 10  # engines report the checksum of what they applied on the first fast push and every 10th


class FastSender:
    """`Sender` (sync/sender.py) over a fast path after the HTTP path's first push. What it reads of the HTTP sender
    is taken here, once: its transport, mode, rules (cap, threshold, verify, trainer group) and adapter config;
    `http` itself is only asked for the HTTP path's pushes and closed with this one."""

    transport_type: type

    def __init__(self, http: WeightSender, adapter_slots: int = 3, verify_every: int = VERIFY_EVERY,
                 plan: PolicyPlan | None = None):
        if type(http.transport) is not self.transport_type:
            raise ValueError(f"{type(self).__name__} runs over a {self.transport_type.__name__}")
        self.http = http
        self.policy = plan if plan is not None else policy_plan(http)
        self.transport: Any = http.transport  # a transport_type (checked above): its clients, group, timeout_s
        self.mode = http.mode
        self.cap, self.threshold, self.verify = http.cap, http.threshold, http.verify
        self.trainer_group = http.trainer_group
        self.adapter_config = http.adapter_config
        self.lora = http.cfg.lora  # EngineMerge: the HTTP path's lora_merge parameters
        self.adapter_slots, self.verify_every = adapter_slots, verify_every
        self.planned = self.active = False
        self.fallback_reason: str | None = None
        self.pushes = 0  # fast pushes made
        self.engine_version = 0
        self.flat: torch.Tensor | None = None
        self.delta: FlatDelta | None = None
        self.nbytes = self.nbuckets = 0

    def arm(self) -> None:
        """`Sender.arm`: nothing to tell here (the colocated sender tells its engines)."""

    def sync(self, version: int) -> SyncReport:
        """Push policy `version` (or skip it, collectively). Call on every trainer rank."""
        if not self.active:
            report = self.http.sync(version)
            self.engine_version = self.http.engine_version
            if report.pushed and not self.planned:
                self.planned = True
                report.note = self._plan()
            return report
        return self._push(version)

    def _plan(self) -> str:
        """The plan, once, right after the HTTP path's first push: the note for the report."""
        raise NotImplementedError

    def _push(self, version: int) -> SyncReport:
        raise NotImplementedError

    def _off(self, reason: str) -> str:
        self.fallback_reason = reason
        log.warning("weight sync keeps the HTTP path: %s", reason)
        return f"fast path off, the HTTP path stays: {reason}"

    def close(self) -> None:
        self.http.close()
