#!/usr/bin/env python3
"""Operator chaos, full size (issue 18 item 1): fuzzed specs against a real API server with the operator running.

    python bench/chaos_operator.py [--specs 500] [--kills 100 --jobs 500] [--seed 18]

Starts its own local control plane (hack/localcluster.py) with our CRDs and KubeRay's and runs `kora operator`;
creates --specs malformed LoRATrainingJobs and LoRAAdapters (tests/fuzzspecs.py: generated from the CRDs'
schemas and the CEL rules, seeded) and every operator-only one (accepted by the CRD, refused by the operator's own
validation), a valid job after every 10; then SIGKILLs the operator --kills times during a
burst of --jobs KubeRay jobs (tests/operator_chaoskit.kill_during_burst); prints the tables and writes
bench/results/chaos_operator_<date>.json. tests/integration/test_chaos_operator.py runs the same at CI size.
Not here yet: runtime-Ray jobs under the kills (duplicate Ray submissions are not counted).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "hack"), str(ROOT / "tests")]

from kubernetes import client, config  # noqa: E402

from fuzzspecs import all_malformed, sample  # noqa: E402
from localcluster import LocalCluster  # noqa: E402
from operator_chaoskit import fuzz_specs, kill_during_burst, kill_table, table  # noqa: E402
from operatorkit import Operator, install_crds  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", type=int, default=500, help="malformed objects to apply (default 500)")
    parser.add_argument("--kills", type=int, default=100, help="operator SIGKILLs during the burst (default 100)")
    parser.add_argument("--jobs", type=int, default=500, help="jobs in the burst (default 500)")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--out", default=str(ROOT / f"bench/results/chaos_operator_{dt.date.today()}.json"),
                        help="result file (empty: none)")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="kora-chaos-"))
    cluster = LocalCluster.start(state)
    try:
        install_crds(cluster)
        cluster.kubectl("create", "namespace", "chaos")
        api = config.new_client_from_config(str(cluster.kubeconfig))
        op = Operator(cluster, ["chaos"], Path("/tmp/kora-logs/operator-chaos.log")).start()
        try:
            r = fuzz_specs(client.CustomObjectsApi(api), client.CoreV1Api(api), "chaos",
                           sample(args.specs, args.seed, model_dir=state / "models"), timeout=300)
            r["operator_crashes"] = 0 if op.healthy() else 1
            cluster.kubectl("create", "namespace", "chaos-kills")
            op.stop()
            op = Operator(cluster, ["chaos-kills"], Path("/tmp/kora-logs/operator-chaos-kills.log")).start()
            kills = kill_during_burst(client.CustomObjectsApi(api), client.CoreV1Api(api), op, "chaos-kills",
                                      args.jobs, args.kills, args.seed, timeout=600)
        finally:
            op.stop()
        r = {"date": str(dt.date.today()), "seed": args.seed, "malformations_generated": len(all_malformed()), **r,
             "kills": kills}
        print(f"fuzzed specs (seed {args.seed}, {r['malformations_generated']} distinct malformations generated)")
        print(table(r))
        print("the operator killed during a burst")
        print(kill_table(kills))
        if args.out:
            Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
            print(f"wrote {args.out}")
        ok = (r["rejected_at_apply"] + r["failed_validation_by_operator"] == r["malformed"]
              and not r["operator_only_refused_at_apply"]
              and r["operator_only_failed_by_operator"] == r["operator_only"]
              and not r["refusals_not_naming_the_field"] and r["child_objects_of_malformed"] == 0
              and r["valid_jobs_reconciled"] == r["valid_jobs_in_between"] and r["operator_crashes"] == 0
              and not kills["jobs_not_exactly_one_set"] and kills["orphans"] == 0 and not kills["secrets_changed"])
        return 0 if ok else 1
    finally:
        cluster.stop()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
