#!/usr/bin/env python3
"""What the LoRATrainingJob CRD's CEL rules cost the API server: per create, and per status patch (the operator's
one write per new job, through the /status subresource).

    python bench/crd_cel_cost.py [--n 500] [--rounds 2]

Starts its own local control plane (hack/localcluster.py) and installs the CRD (manifests/crds) under two more
groups side by side: as generated (`rules`), and with every x-kubernetes-validations rule taken out (`none`, the
anchor). With --variants it also tries `no-transition` (the `self == oldSelf` immutability rules taken out) and
`guarded` (every spec-level rule made `(oldSelf.hasValue() && oldSelf.value() == self) || (rule)` with
optionalOldSelf, so that an update leaving the spec alone would skip it). For each variant in turn (the order
reversed every other round) it creates N jobs with --concurrency threads, then patches each one's status once with
a status like the operator's first, and prints the API server's CPU seconds for each, and the ratio to the anchor.
The API server evaluates every rule of the object on every write, the status subresource's included
(apiextensions-apiserver's statusStrategy.ValidateUpdate runs the CEL validator over the whole object; ratcheting
only turns errors of unchanged fields into warnings). Writes bench/results/crd_cel_cost_<date>.json.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "hack"))
sys.path.insert(0, str(ROOT / "bench"))

from kubernetes import client, config  # noqa: E402

from localcluster import LocalCluster, wait_for  # noqa: E402
from operator_scale import cpu_s, job  # noqa: E402

CRD = ROOT / "manifests/crds/kora.dev_loratrainingjobs.yaml"
RULES = "x-kubernetes-validations"
STATUS = {"phase": "Pending", "syncMode": "Merge", "observedGeneration": 1, "rayJobName": "x-ray",
          "conditions": [{"type": t, "status": s, "reason": r, "message": f"{t} is {s} ({r})",
                          "lastTransitionTime": "2026-12-04T00:00:00Z", "observedGeneration": 1}
                         for t, s, r in [("Validated", "True", "Validated"), ("ClusterReady", "False", "Provisioning"),
                                         ("Training", "False", "ClusterNotReady")]]}


def _walk(node: Any, visit: Callable[[dict[str, Any]], None]) -> None:
    if isinstance(node, dict):
        visit(node)
        for v in node.values():
            _walk(v, visit)
    elif isinstance(node, list):
        for v in node:
            _walk(v, visit)


def _keep_rules(keep: Callable[[dict[str, Any]], bool]) -> Callable[[dict[str, Any]], None]:
    def visit(node: dict[str, Any]) -> None:
        if RULES in node:
            node[RULES] = [r for r in node[RULES] if keep(r)]
            if not node[RULES]:
                del node[RULES]
    return visit


def _guard(crd: dict[str, Any]) -> None:
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for rule in spec[RULES]:
        rule["rule"] = f"(oldSelf.hasValue() && oldSelf.value() == self) || ({rule['rule']})"
        rule["optionalOldSelf"] = True


def variant(base: dict[str, Any], name: str) -> dict[str, Any]:
    """The CRD under the group <name>.cel.kora.dev, its rules changed as `name` says."""
    crd = copy.deepcopy(base)
    group = f"{name}.cel.kora.dev"
    crd["metadata"]["name"] = f"{crd['spec']['names']['plural']}.{group}"
    crd["spec"]["group"] = group
    if name == "none":
        _walk(crd, _keep_rules(lambda r: False))
    elif name == "no-transition":
        _walk(crd, _keep_rules(lambda r: "oldSelf" not in r["rule"]))
    elif name == "guarded":
        _guard(crd)
    return crd


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="jobs per variant and round (default 500)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--variants", default="rules,none", help="rules, none, no-transition, guarded")
    parser.add_argument("--out", default=str(ROOT / f"bench/results/crd_cel_cost_{dt.date.today()}.json"))
    args = parser.parse_args()
    names = args.variants.split(",")
    base = yaml.safe_load(CRD.read_text())
    state = Path(tempfile.mkdtemp(prefix="kora-celcost-"))
    cluster = LocalCluster.start(state)
    try:
        for name in names:
            path = state / f"{name}.yaml"
            path.write_text(yaml.safe_dump(variant(base, name)))
            cluster.kubectl("apply", "--server-side", "-f", str(path))
            crd_name = f"loratrainingjobs.{name}.cel.kora.dev"
            wait_for(lambda crd_name=crd_name: cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd_name}",
                                                               "--timeout=30s", check=False).returncode == 0,
                     timeout=60, what=f"CRD {crd_name} established")
        config.load_kube_config(str(cluster.kubeconfig))
        cfg = client.Configuration.get_default_copy()
        cfg.connection_pool_maxsize = args.concurrency + 2
        api = client.CustomObjectsApi(client.ApiClient(cfg))
        apiserver = cluster.pids["kube-apiserver"]
        cpu: dict[str, dict[str, list[float]]] = {name: {"create": [], "status": []} for name in names}
        for rnd in range(args.rounds):
            for name in names if rnd % 2 == 0 else names[::-1]:
                group, ns = f"{name}.cel.kora.dev", f"r{rnd}-{name}"
                cluster.kubectl("create", "namespace", ns)

                def create(i: int, group: str = group, ns: str = ns) -> None:
                    api.create_namespaced_custom_object(group, "v1alpha1", ns, "loratrainingjobs",
                                                        {**job(f"job-{i}"), "apiVersion": f"{group}/v1alpha1"})

                def status(i: int, group: str = group, ns: str = ns) -> None:
                    api.patch_namespaced_custom_object_status(group, "v1alpha1", ns, "loratrainingjobs", f"job-{i}",
                                                              {"status": STATUS})

                for what, call in (("create", create), ("status", status)):
                    before, t0 = cpu_s(apiserver), time.monotonic()
                    with ThreadPoolExecutor(args.concurrency) as pool:
                        list(pool.map(call, range(args.n)))
                    used = cpu_s(apiserver) - before
                    cpu[name][what].append(round(used, 2))
                    print(f"round {rnd} {name:14} {what:7} API server CPU {used:6.2f} s, "
                          f"wall {time.monotonic() - t0:6.2f} s", flush=True)
        result = {"bench": "crd_cel_cost", "date": str(dt.date.today()), "n": args.n, "concurrency": args.concurrency,
                  "api_server_cpu_s": cpu, "ms_per_write": {}}
        anchor = ({what: sum(cpu["none"][what]) / args.rounds for what in ("create", "status")}
                  if "none" in cpu else None)
        for name in names:
            row = []
            for what in ("create", "status"):
                mean = sum(cpu[name][what]) / args.rounds
                result["ms_per_write"].setdefault(name, {})[what] = round(1000 * mean / args.n, 2)
                ratio = f" ({mean / anchor[what]:.2f}x the rule-less CRD)" if anchor else ""
                row.append(f"{what} {1000 * mean / args.n:5.2f} ms{ratio}")
            print(f"{name:14} API server CPU per write: " + "; ".join(row))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {args.out}")
        return 0
    finally:
        cluster.stop()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
