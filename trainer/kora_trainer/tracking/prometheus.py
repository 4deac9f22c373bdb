"""The trainer's Prometheus metrics, served as `GET /metrics` by its control plane (control_plane.py).

They are read at scrape time from the same progress the control plane's /status answers (config/status.py's
TrainerStatus), so the two can never disagree and nothing is counted twice. A value the run does not have yet
(no checkpoint, no on-policy step) is left out rather than exported as 0. Each scrape of a PodMonitor adds the pod's
labels (the chart's PodMonitor copies `kora.dev/job-name` onto every series).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kora_trainer.config.status import TrainerPhase

PREFIX = "kora_trainer_"
# metric name (after PREFIX) -> (help, the /status keys it is read from)
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "step": ("Optimizer steps done", ("step",)),
    "total_steps": ("Steps the job will run (0: a multi-adapter service)", ("totalSteps",)),
    "reward_mean": ("Mean training reward of the last step", ("rewardMean",)),
    "synced_step": ("The last step whose policy the engines serve (pushed or delta-skipped)", ("syncedStep",)),
    "last_sync_milliseconds": ("Wall time of the last weight push", ("lastSync", "milliseconds")),
    "last_sync_bytes": ("Bytes of the last weight push", ("lastSync", "bytes")),
    "last_sync_adapter_version": ("Policy version the engines serve", ("lastSync", "adapterVersion")),
    "logp_gap_max": ("Serving check: largest |trainer - engine| log-prob of the last on-policy step's sampled tokens",
                     ("servingCheck", "logpGapMax")),
    "logp_gap_mean": ("Serving check: mean |trainer - engine| log-prob of the last on-policy step's sampled tokens",
                      ("servingCheck", "logpGapMean")),
    "checkpoint_step": ("Step held by the last checkpoint", ("lastCheckpoint", "step")),
    "seconds_per_step": ("Wall seconds per step over the last steps", ("secondsPerStep",)),
    "estimated_remaining_seconds": ("Seconds until the last step at the measured rate",
                                    ("estimatedRemainingSeconds",)),
    "active_adapters": ("Multi-adapter jobs: adapters holding a slot", ("activeAdapters",)),
}
CHECKPOINT_AGE = "checkpoint_age_seconds"
PHASE = "phase"


def _at(snapshot: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    value: Any = snapshot
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


class TrainerCollector(Collector):
    """Gauges from `snapshot()` (a /status answer) on every scrape."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        for name, (doc, keys) in GAUGES.items():
            value = _at(s, keys)
            if value is not None:
                yield GaugeMetricFamily(PREFIX + name, doc, value=float(value))
        written = _at(s, ("lastCheckpoint", "time"))
        if written:
            age = datetime.now(UTC) - datetime.fromisoformat(str(written).replace("Z", "+00:00"))
            yield GaugeMetricFamily(PREFIX + CHECKPOINT_AGE, "Seconds since the last checkpoint was written",
                                    value=max(0.0, age.total_seconds()))
        phase = GaugeMetricFamily(PREFIX + PHASE, "1 for the run's phase (Starting, Running, Succeeded, Failed)",
                                  labels=["phase"])
        for p in TrainerPhase:
            phase.add_metric([str(p)], float(s.get("phase") == p))
        yield phase


def trainer_registry(snapshot: Callable[[], Mapping[str, Any]]) -> CollectorRegistry:
    """A registry of its own per control plane (a test process may run several), holding the trainer's gauges."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TrainerCollector(snapshot))
    return registry
