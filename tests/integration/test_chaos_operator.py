"""Operator chaos at CI size (issue 18 item 1): fuzzed specs against the real API server with the operator running,
and the operator SIGKILLed during bursts of KubeRay jobs and of runtime-Ray jobs (a real local Ray head). The full
size is `make chaos` (bench/chaos_operator.py)."""

from __future__ import annotations

from pathlib import Path

from kubernetes import client, config

from fuzzspecs import operator_only, sample
from operator_chaoskit import fuzz_specs, kill_during_burst, kill_table, ray_kill_during_burst, ray_kill_table, table
from operatorkit import Operator, install_crds
from raykit import operator_env

LOGS = Path("/tmp/kora-logs")
CI_SPECS = 60


def test_fuzzed_specs_are_refused_naming_their_field_and_get_no_children(cluster, namespace, tmp_path):
    ns = namespace
    install_crds(cluster)
    api = config.new_client_from_config(str(cluster.kubeconfig))
    items = sample(CI_SPECS, seed=18, model_dir=tmp_path)  # and every operator-only one
    op = Operator(cluster, [ns], LOGS / f"operator-{ns}.log").start()
    try:
        r = fuzz_specs(client.CustomObjectsApi(api), client.CoreV1Api(api), ns, items)
        r["operator_crashes"] = 0 if op.healthy() else 1
        print("\n" + table(r))
    finally:
        op.stop()
    assert r["refusals_not_naming_the_field"] == [], r["refusals_not_naming_the_field"]
    assert r["rejected_at_apply"] + r["failed_validation_by_operator"] == len(items)
    # the ones past the CRD: accepted at apply, every one Failed/ValidationFailed by the operator
    assert r["operator_only_refused_at_apply"] == [], r["operator_only_refused_at_apply"]
    assert r["operator_only_failed_by_operator"] == r["operator_only"] == len(operator_only(tmp_path)) > 0
    assert r["child_objects_of_malformed"] == 0
    assert r["valid_jobs_reconciled"] == r["valid_jobs_in_between"] > 0
    assert r["operator_crashes"] == 0


CI_JOBS, CI_KILLS = 24, 8


def test_the_operator_killed_during_a_burst_leaves_one_set_of_children_per_job(cluster, namespace):
    install_crds(cluster)
    api = config.new_client_from_config(str(cluster.kubeconfig))
    op = Operator(cluster, [namespace], LOGS / f"operator-{namespace}.log").start()
    try:
        r = kill_during_burst(client.CustomObjectsApi(api), client.CoreV1Api(api), op, namespace, CI_JOBS, CI_KILLS,
                              seed=18)
        print("\n" + kill_table(r))
    finally:
        op.stop()
    assert r["jobs"] == CI_JOBS and r["kills"] == CI_KILLS
    assert r["jobs_not_exactly_one_set"] == [] and r["orphans"] == 0 and r["secrets_changed"] == []


CI_RAY_JOBS, CI_RAY_KILLS = 6, 4


def test_the_operator_killed_during_a_burst_of_runtime_ray_jobs_submits_each_once(cluster, namespace, head,
                                                                                  control_port, tmp_path):
    install_crds(cluster)
    api = config.new_client_from_config(str(cluster.kubeconfig))
    op = Operator(cluster, [namespace], LOGS / f"operator-{namespace}.log", env=operator_env(head, control_port))
    op.start()
    try:
        r = ray_kill_during_burst(client.CustomObjectsApi(api), client.CoreV1Api(api), op, head, namespace,
                                  tmp_path, CI_RAY_JOBS, CI_RAY_KILLS, seed=18)
        print("\n" + ray_kill_table(r))
    finally:
        # the jobs' finalizers stop their Ray jobs: delete them while the operator runs
        cluster.kubectl("delete", "ltj", "--all", "-n", namespace, "--wait=true", "--timeout=120s", check=False)
        op.stop()
    assert r["jobs"] == CI_RAY_JOBS and r["kills"] == CI_RAY_KILLS
    assert r["jobs_not_exactly_one_submission"] == [] and r["submissions"] == CI_RAY_JOBS
    assert r["jobs_not_exactly_one_set"] == [] and r["orphans"] == 0
