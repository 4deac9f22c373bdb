"""Kill the operator (SIGKILL) in the middle of creating children, restart it: still exactly one
ConfigMap, Secret and RayJob per job, and no Secret's token rotated."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config, watch

from localcluster import wait_for
from operatorkit import Operator, all_children, apply, children, get, install_crds, job_status
from specs import set_path, valid_job

N = 20
LOGS = Path("/tmp/kora-logs")


@pytest.fixture
def ns(cluster):
    install_crds(cluster)
    name = f"restart-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def counts(cluster, ns):
    out = json.loads(cluster.kubectl("get", "configmaps,secrets,networkpolicies,rayjobs.ray.io", "-n", ns,
                                     "-l", "app.kubernetes.io/managed-by=kora", "-o", "json").stdout)["items"]
    per_kind: dict[str, int] = {}
    for item in out:
        per_kind[item["kind"]] = per_kind.get(item["kind"], 0) + 1
    # the Secrets' values: each job's token (derived) and engine admin key (random, made once)
    return per_kind, {i["metadata"]["name"]: i.get("data") for i in out if i["kind"] == "Secret"}


def test_kill_mid_reconcile_then_restart_leaves_one_of_each(cluster, ns):
    op = Operator(cluster, [ns], LOGS / f"operator-{ns}.log").start()
    try:
        # a watch, not kubectl polling: polling is slower than the operator, which would be done
        # with every job before a poll noticed the first ConfigMap
        core = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
        first = threading.Event()

        def kill_on_first_configmap() -> None:
            w = watch.Watch()
            for _ in w.stream(core.list_namespaced_config_map, ns, label_selector="app.kubernetes.io/managed-by=kora",
                              timeout_seconds=30):
                op.kill()
                first.set()
                break
            w.stop()

        killer = threading.Thread(target=kill_on_first_configmap, daemon=True)
        killer.start()
        docs = [valid_job(f"job-{i}") for i in range(N)]
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs))
        assert first.wait(timeout=30), "no ConfigMap appeared"
        killer.join(timeout=10)
        at_kill, tokens_at_kill = counts(cluster, ns)
        # the point of the test: some jobs were caught half-way (else it proves nothing)
        assert at_kill.get("RayJob", 0) < N, at_kill
        op.start()

        def converged():
            got = counts(cluster, ns)[0]
            return got if got == {"ConfigMap": N, "Secret": 2 * N, "NetworkPolicy": N, "RayJob": N} else None

        wait_for(converged, timeout=60, interval=0.3, what=f"one child of each kind per job (killed at {at_kill})")
        for i in range(N):
            assert all_children(children(cluster, f"job-{i}", ns))
        _, tokens = counts(cluster, ns)
        for name, token in tokens_at_kill.items():
            assert tokens[name] == token, f"{name}'s token or key changed across the restart"
        print(f"killed with {at_kill} of {N} jobs' children created; converged after restart")
    finally:
        op.stop()


def test_a_spec_changed_and_a_rayjob_deleted_while_the_operator_was_down_are_seen_when_it_starts(cluster, ns):
    # the operator keeps kopf's record of what it handled in memory, not on the job: after a restart the job's
    # status.observedGeneration says whether its spec was handled (handlers/kopf_state.py); and it takes a job's
    # other children to exist only when its RayJob does (handlers/jobs.py ray_job_owners)
    op = Operator(cluster, [ns], LOGS / f"operator-{ns}.log").start()
    try:
        for name in ("changed", "robbed"):
            apply(cluster, valid_job(name), ns)
        wait_for(lambda: all(job_status(cluster, n, ns).get("phase") == "Pending" for n in ("changed", "robbed")),
                 timeout=60, interval=0.3, what="both jobs Pending")
        rayjob = {n: children(cluster, n, ns)["RayJob"][0]["metadata"] for n in ("changed", "robbed")}
        op.stop()
        apply(cluster, set_path(valid_job("changed"), "suspend", True), ns)
        cluster.kubectl("delete", "rayjob", rayjob["robbed"]["name"], "-n", ns)
        op.start()
        wait_for(lambda: (get(cluster, "rayjob", rayjob["changed"]["name"], ns) or {}).get("spec", {}).get("suspend"),
                 timeout=60, interval=0.3, what="the suspend set while the operator was down on the RayJob")
        wait_for(lambda: (r := get(cluster, "rayjob", rayjob["robbed"]["name"], ns))
                 and r["metadata"]["uid"] != rayjob["robbed"]["uid"], timeout=60, interval=0.3,
                 what="the RayJob deleted while the operator was down made again")
        # the status is written behind the reconcile that patched the RayJob (statuses.py): wait for it
        changed = wait_for(lambda: (j := get(cluster, "ltj", "changed", ns))
                           and j["status"].get("observedGeneration") == 2 and j, timeout=60, interval=0.3,
                           what="status.observedGeneration 2 on the changed job")
        assert changed["metadata"]["generation"] == 2
    finally:
        op.stop()
