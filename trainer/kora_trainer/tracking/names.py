"""One step's numbers -> `{tag: value}` for the trackers. Tags follow verl's names where verl logs the same
quantity (critic/score/*, response_length/*, actor/*, timing_s/*, perf/*); what verl has no name for is kora's
(sync/*, rollout/*). docs/metrics.md tables every tag with where it comes from; keep the two in step.

Values are read off the StepMetrics (backends/grpo_step.py) or AdapterStepMetrics (backends/multi_lora.py) that
the step returned, the rollout stats (gen_ms) and the step's sync report; nothing is recomputed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# tag -> the metrics field it is (a field an adapter's metrics lack is left out of its series)
FIELDS: dict[str, str] = {
    "critic/score/mean": "reward_mean",
    "critic/score/std": "reward_std",
    "critic/score/max": "reward_max",
    "critic/score/min": "reward_min",
    "response_length/mean": "response_len",
    "response_length/max": "response_len_max",
    "response_length/min": "response_len_min",
    "actor/pg_loss": "loss",
    "actor/pg_clipfrac": "clip_frac",
    "actor/ppo_kl": "ppo_kl",
    "actor/entropy": "entropy",
    "actor/grad_norm": "grad_norm",
    "actor/lr": "lr",
    "actor/ratio_mean": "ratio",
    "perf/total_num_tokens": "tokens",
    "rollout/version_lag": "rollout_version_lag",
    "rollout/logp_gap_max": "rollout_logp_gap_max",  # None (left out) for rollouts of an older policy: async
    "rollout/logp_gap_mean": "rollout_logp_gap_mean",
    "rollout/stale_logp_gap_max": "stale_logp_gap_max",  # what an engine one push behind would show (grpo_step.py)
}
KL_TAG = "actor/kl_loss"  # only where measured: algorithm.klCoef > 0 or tracking.klToBase


def _fields(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {tag: float(metrics[f]) for tag, f in FIELDS.items() if metrics.get(f) is not None}
    if metrics.get("kl_measured"):
        out[KL_TAG] = float(metrics["kl"])
    return out


def _sync(report: Mapping[str, Any]) -> dict[str, float]:
    return {
        "timing_s/update_weights": float(report["ms"]) / 1000,
        "sync/bytes": float(report["bytes"]),
        "sync/pushed": float(bool(report["pushed"])),
        "sync/fast_path": float(report.get("path") == "fast"),  # 0: the HTTP path (per bucket)
        "sync/adapter_version": float(report["adapter_version"] or 0),
    }


def step_scalars(metrics: Mapping[str, Any], gen_ms: float, report: Mapping[str, Any],
                 step_s: float | None) -> dict[str, float]:
    """A single-adapter job's step: `metrics` is StepMetrics.as_dict(), `report` the step's SyncReport.as_dict(),
    `step_s` the wall time since the previous step ended (None for the first step of a process)."""
    out = _fields(metrics)
    out["timing_s/gen"] = gen_ms / 1000
    out["timing_s/log_probs"] = float(metrics["logprob_ms"]) / 1000
    out["timing_s/update_actor"] = (float(metrics["train_ms"]) - float(metrics["logprob_ms"])) / 1000
    out["timing_s/dp_allreduce"] = float(metrics["dp_allreduce_ms"]) / 1000
    out.update(_sync(report))
    if step_s is not None and step_s > 0:
        out["timing_s/step"] = step_s
        out["perf/time_per_step"] = step_s
        out["perf/throughput"] = float(metrics["tokens"]) / step_s
    return out


def adapter_scalars(metrics: Mapping[str, Any], gen_ms: float, report: Mapping[str, Any]) -> dict[str, float]:
    """One adapter's step in a multi-adapter job, each tag under `<adapter>/` (one series per adapter)."""
    out = _fields(metrics)
    out["timing_s/gen"] = gen_ms / 1000
    out["timing_s/update_actor"] = float(metrics["train_ms"]) / 1000
    out.update(_sync(report))
    return {f"{metrics['name']}/{tag}": value for tag, value in out.items()}


def checkpoint_scalars(ms: float, prefix: str = "") -> dict[str, float]:
    return {f"{prefix}timing_s/save_checkpoint": ms / 1000}
