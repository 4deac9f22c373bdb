"""The chart's Grafana dashboard (charts/kora/dashboards/kora.json): valid JSON, and every query names only metrics
that exist — in the trainer's registry (the control plane's /metrics) or the operator's (kora_operator.metrics)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kora_operator.metrics  # noqa: F401  (registers the operator's metrics on the default registry)
from kora_trainer.config.status import rfc3339
from kora_trainer.tracking.prometheus import trainer_registry

DASHBOARD = Path(__file__).resolve().parents[2] / "charts/kora/dashboards/kora.json"
# a status with every field set, so that the trainer's registry exports every gauge it has
FULL_STATUS = {"step": 3, "totalSteps": 10, "rewardMean": 0.5, "syncedStep": 3, "phase": "Running",
               "lastSync": {"milliseconds": 12.0, "bytes": 10, "adapterVersion": 3},
               "servingCheck": {"logpGapMax": 1e-6, "logpGapMean": 1e-7},
               "lastCheckpoint": {"step": 3, "time": rfc3339()}, "secondsPerStep": 1.0,
               "estimatedRemainingSeconds": 7, "activeAdapters": 2}
PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "le", "max", "min", "avg", "without"}


def known_metrics() -> set[str]:
    """Every sample name the two registries export, read back through prometheus_client's text parser."""
    names = set()
    for registry in (trainer_registry(lambda: FULL_STATUS), REGISTRY):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            names.add(family.name)
            names.update(s.name for s in family.samples)
    # a counter or histogram with labels exports no sample before its first observation: name its series
    for family in REGISTRY.collect():
        if family.name.startswith("kora_"):
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            names.update(family.name + s for s in suffixes)
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers outside label matchers, grouping clauses, strings
    and range selectors that are not PromQL's own words."""
    bare = re.sub(r"\{[^}]*\}|\b(by|without)\s*\([^)]*\)|\"[^\"]*\"|\[[^\]]*\]", " ", expr)
    return {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare) if w not in PROMQL_WORDS}


def queries(dashboard: dict) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return out


def test_dashboard_is_json_and_every_query_names_a_metric_that_exists():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    exprs = queries(dashboard)
    assert len(exprs) >= 10
    known = known_metrics()
    assert "kora_trainer_step" in known and "kora_reconciles_total" in known  # both registries were read
    for expr in exprs:
        named = metric_names(re.sub(r"label_values\(([^,]+),[^)]*\)", r"(\1)", expr))  # its 2nd argument: a label
        assert named, f"no metric in {expr!r}"
        assert named <= known, f"{expr!r} names {sorted(named - known)}, which no registry exports"
    # the trainer panels cover what the issue lists: step/total, reward, sync, gap, checkpoint age, ETA
    wanted = {"kora_trainer_step", "kora_trainer_total_steps", "kora_trainer_reward_mean",
              "kora_trainer_last_sync_milliseconds", "kora_trainer_last_sync_bytes", "kora_trainer_logp_gap_max",
              "kora_trainer_checkpoint_age_seconds", "kora_trainer_estimated_remaining_seconds"}
    assert wanted <= set().union(*map(metric_names, exprs))


def test_the_name_check_can_fail():
    assert metric_names('sum by (kind) (rate(kora_not_a_metric_total{a="b"}[5m]))') == {"kora_not_a_metric_total"}
    assert "kora_not_a_metric_total" not in known_metrics()
