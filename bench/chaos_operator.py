#!/usr/bin/env python3
"""Operator chaos, full size (issue 18 item 1): fuzzed specs against a real API server with the operator running.

    python bench/chaos_operator.py [--specs 500] [--kills 100 --jobs 500] [--ray-kills 100 --ray-jobs 100] [--seed 18]

Starts its own local control plane (hack/localcluster.py) with our CRDs and KubeRay's and runs `kora operator`;
creates --specs malformed LoRATrainingJobs and LoRAAdapters (tests/fuzzspecs.py: generated from the CRDs'
schemas and the CEL rules, seeded) and every operator-only one (accepted by the CRD, refused by the operator's own
validation), a valid job after every 10; then SIGKILLs the operator --kills times during a
burst of --jobs KubeRay jobs (tests/operator_chaoskit.kill_during_burst), and --ray-kills times during a burst of
--ray-jobs runtime-Ray jobs submitted to a local Ray head of its own (hack/localray.py; operator_chaoskit.
ray_kill_during_burst: Ray job submissions counted per job uid); prints the tables and writes
bench/results/chaos_operator_<date>.json. tests/integration/test_chaos_operator.py runs the same at CI size.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "hack"), str(ROOT / "tests")]

from kubernetes import client, config  # noqa: E402

from fuzzspecs import all_malformed, sample  # noqa: E402
from localcluster import LocalCluster, free_ports  # noqa: E402
from operator_chaoskit import (  # noqa: E402
    fuzz_specs,
    kill_during_burst,
    kill_table,
    ray_kill_during_burst,
    ray_kill_table,
    table,
)
from operatorkit import Operator, install_crds  # noqa: E402
from raykit import operator_env, ray_head  # noqa: E402

PARTS = ("specs", "kills", "ray")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", type=int, default=500, help="malformed objects to apply (default 500)")
    parser.add_argument("--kills", type=int, default=100, help="operator SIGKILLs during the burst (default 100)")
    parser.add_argument("--jobs", type=int, default=500, help="jobs in the burst (default 500)")
    parser.add_argument("--ray-kills", type=int, default=100, help="operator SIGKILLs during the runtime-Ray burst")
    parser.add_argument("--ray-jobs", type=int, default=100, help="runtime-Ray jobs in that burst (every other one "
                        "a Ray job sleeping on the local head until the end, the rest exit 0)")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--out", default=str(ROOT / f"bench/results/chaos_operator_{dt.date.today()}.json"),
                        help="result file (empty: none)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run (default all: {','.join(PARTS)})")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    state = Path(tempfile.mkdtemp(prefix="kora-chaos-"))
    cluster = LocalCluster.start(state)
    try:
        install_crds(cluster)
        api = config.new_client_from_config(str(cluster.kubeconfig))
        r: dict[str, Any] = {"date": str(dt.date.today()), "seed": args.seed}
        ok = True
        if "specs" in parts:
            r["specs"] = specs = fuzzed(cluster, api, state, args)
            print(f"fuzzed specs (seed {args.seed}, {specs['malformations_generated']} distinct malformations "
                  "generated, and the operator-only ones)")
            print(table(specs))
            ok &= (specs["rejected_at_apply"] + specs["failed_validation_by_operator"] == specs["malformed"]
                   and not specs["operator_only_refused_at_apply"]
                   and specs["operator_only_failed_by_operator"] == specs["operator_only"]
                   and not specs["refusals_not_naming_the_field"] and specs["child_objects_of_malformed"] == 0
                   and specs["valid_jobs_reconciled"] == specs["valid_jobs_in_between"]
                   and specs["operator_crashes"] == 0)
        if "kills" in parts:
            r["kills"] = kills = kuberay_kills(cluster, api, args)
            print("the operator killed during a burst of KubeRay jobs")
            print(kill_table(kills))
            ok &= not kills["jobs_not_exactly_one_set"] and kills["orphans"] == 0 and not kills["secrets_changed"]
        if "ray" in parts:
            r["ray_kills"] = ray = ray_kills(cluster, api, state, args)
            print("the operator killed during a burst of runtime-Ray jobs")
            print(ray_kill_table(ray))
            ok &= not ray["jobs_not_exactly_one_submission"] and not ray["jobs_not_exactly_one_set"] \
                and ray["orphans"] == 0
        if args.out:
            Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
            print(f"wrote {args.out}")
        return 0 if ok else 1
    finally:
        cluster.stop()
        shutil.rmtree(state, ignore_errors=True)


def fuzzed(cluster: LocalCluster, api: Any, state: Path, args: argparse.Namespace) -> dict[str, Any]:
    ns = "chaos"
    cluster.kubectl("create", "namespace", ns)
    with Operator(cluster, [ns], Path(f"/tmp/kora-logs/operator-{ns}.log")).running() as op:
        r = fuzz_specs(client.CustomObjectsApi(api), client.CoreV1Api(api), ns,
                       sample(args.specs, args.seed, model_dir=state / "models"), timeout=300)
        r["operator_crashes"] = 0 if op.healthy() else 1
    return {"malformations_generated": len(all_malformed()), **r}


def kuberay_kills(cluster: LocalCluster, api: Any, args: argparse.Namespace) -> dict[str, Any]:
    ns = "chaos-kills"
    cluster.kubectl("create", "namespace", ns)
    with Operator(cluster, [ns], Path(f"/tmp/kora-logs/operator-{ns}.log")).running() as op:
        return kill_during_burst(client.CustomObjectsApi(api), client.CoreV1Api(api), op, ns, args.jobs, args.kills,
                                 args.seed, timeout=600)


def ray_kills(cluster: LocalCluster, api: Any, state: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The runtime-Ray burst: a Ray head of its own, the operator submitting the scripted trainer to it."""
    ns = "chaos-ray-kills"
    cluster.kubectl("create", "namespace", ns)
    (state / "ray-cwd").mkdir()
    with ray_head(state / "ray-cwd") as head:
        op = Operator(cluster, [ns], Path(f"/tmp/kora-logs/operator-{ns}.log"),
                      env=operator_env(head, free_ports(1)[0])).start()
        try:
            return ray_kill_during_burst(client.CustomObjectsApi(api), client.CoreV1Api(api), op, head, ns,
                                         state / "ray-homes", args.ray_jobs, args.ray_kills, args.seed, timeout=600)
        finally:
            cluster.kubectl("delete", "ltj", "--all", "-n", ns, "--wait=true", "--timeout=300s", check=False)
            op.stop()


if __name__ == "__main__":
    raise SystemExit(main())
