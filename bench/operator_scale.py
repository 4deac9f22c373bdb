#!/usr/bin/env python3
"""How fast does the operator turn N LoRATrainingJobs into RayJobs, against the floor of creating
the same N RayJobs directly through the API?

    python bench/operator_scale.py [--n 500] [--concurrency 8]

Starts its own local control plane (hack/localcluster.py: etcd + kube-apiserver +
kube-controller-manager on 127.0.0.1) with our CRDs and KubeRay's, and runs `kora operator` as a
subprocess. Both runs create their N objects the same way (the Python client, `--concurrency`
threads) while one watch per run records when each RayJob appears.

Prints: per-object latency from create to RayJob seen (p50/p99), time until all N exist, the
operator's peak RSS, the same for N RayJobs created directly (the floor), and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "hack"))

from kubernetes import client, config, watch  # noqa: E402

from localcluster import LocalCluster, free_ports, wait_for  # noqa: E402

KORA = Path(sys.executable).with_name("kora")


def job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kora.dev/v1alpha1", "kind": "LoRATrainingJob", "metadata": {"name": name},
        "spec": {"model": {"path": "/models/tiny", "volume": {"hostPath": {"path": "/tmp"}}},
                 "lora": {"rank": 8, "syncMode": "Merge"}, "data": {"path": "/data/train.parquet"}},
    }


def watch_rayjobs(api: Any, ns: str, n: int, seen: dict[str, float], done: threading.Event) -> None:
    """Record the local time each RayJob in `ns` is first seen, until n were seen."""
    w = watch.Watch()
    for ev in w.stream(api.list_namespaced_custom_object, "ray.io", "v1", ns, "rayjobs", timeout_seconds=600):
        name = ev["object"]["metadata"]["name"]
        if ev["type"] == "ADDED" and name not in seen:
            seen[name] = time.monotonic()
            if len(seen) >= n:
                break
    w.stop()
    done.set()


def run(api: Any, ns: str, n: int, concurrency: int, make: Any) -> dict[str, float]:
    """Create n objects with `make(i)` (returns the RayJob name it leads to); measure."""
    seen: dict[str, float] = {}
    done = threading.Event()
    watcher = threading.Thread(target=watch_rayjobs, args=(api, ns, n, seen, done), daemon=True)
    watcher.start()
    time.sleep(0.5)  # let the watch open before the first create (bench script, not a handler)
    created: dict[str, float] = {}
    t0 = time.monotonic()

    def one(i: int) -> None:
        rayjob = make(i)
        created[rayjob] = time.monotonic()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))
    t_created = time.monotonic() - t0
    if not done.wait(timeout=600):
        raise SystemExit(f"only {len(seen)} of {n} RayJobs appeared within 600 s")
    lat = sorted(seen[k] - created[k] for k in created)
    return {
        "create_all_s": t_created,
        "all_exist_s": max(seen.values()) - t0,
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="jobs to create (default 500)")
    parser.add_argument("--concurrency", type=int, default=8, help="client threads creating objects")
    parser.add_argument("--keep-logs", default="/tmp/kora-logs/operator-scale.log", help="operator log file")
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="kora-bench-"))
    cluster = LocalCluster.start(state)
    op: subprocess.Popen[bytes] | None = None
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "manifests/crds"))
        cluster.kubectl("apply", "--server-side", "-f", str(cluster.bin_dir / "kuberay-crds"))
        # right after creation a CRD has no conditions yet and `kubectl wait` errors out: retry it
        wait_for(lambda: cluster.kubectl("wait", "--for=condition=Established", "crd/loratrainingjobs.kora.dev",
                                         "crd/rayjobs.ray.io", "--timeout=30s", check=False).returncode == 0,
                 timeout=60, what="CRDs established")
        for ns in ("bench-operator", "bench-direct"):
            cluster.kubectl("create", "namespace", ns)
        config.load_kube_config(str(cluster.kubeconfig))
        cfg = client.Configuration.get_default_copy()
        cfg.connection_pool_maxsize = args.concurrency + 2
        api = client.CustomObjectsApi(client.ApiClient(cfg))

        # the floor: the RayJobs the operator would make, created directly
        sys.path.insert(0, str(ROOT / "operator"))
        from kora_operator.builders.rayjob import build_ray_job
        from kora_operator.validation import validate_job

        def direct(i: int) -> str:
            parsed, _ = validate_job({**job(f"job-{i}"), "metadata": {"name": f"job-{i}", "namespace": "bench-direct"}})
            assert parsed is not None
            body = build_ray_job(parsed)
            api.create_namespaced_custom_object("ray.io", "v1", "bench-direct", "rayjobs", body)
            return str(body["metadata"]["name"])

        floor = run(api, "bench-direct", args.n, args.concurrency, direct)

        liveness, metrics = free_ports(2)
        Path(args.keep_logs).parent.mkdir(parents=True, exist_ok=True)
        with open(args.keep_logs, "wb") as log:
            op = subprocess.Popen(
                [str(KORA), "operator", "--namespace", "bench-operator", "--liveness",
                 f"http://127.0.0.1:{liveness}/healthz", "--metrics-port", str(metrics), "--metrics-address",
                 "127.0.0.1"], env=cluster.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=2).status == 200,
                 timeout=60, what="operator liveness")
        rss_idle = peak_rss_mib(op.pid)

        def via_operator(i: int) -> str:
            api.create_namespaced_custom_object("kora.dev", "v1alpha1", "bench-operator", "loratrainingjobs",
                                                job(f"job-{i}"))
            return f"job-{i}-ray"

        ours = run(api, "bench-operator", args.n, args.concurrency, via_operator)
        rss_peak = peak_rss_mib(op.pid)
        result = {
            "n": args.n, "concurrency": args.concurrency,
            "operator": {k: round(v, 1) for k, v in ours.items()},
            "direct_floor": {k: round(v, 1) for k, v in floor.items()},
            "operator_rss_mib": {"idle": round(rss_idle, 1), "peak": round(rss_peak, 1)},
            "ratio_all_exist": round(ours["all_exist_s"] / floor["all_exist_s"], 2),
            "ratio_p50": round(ours["p50_ms"] / floor["p50_ms"], 2),
        }
        print(f"N={args.n} (concurrency {args.concurrency}, {os.cpu_count()} CPUs)")
        print(f"  operator : all {ours['all_exist_s']:.1f} s, create->RayJob p50 {ours['p50_ms']:.0f} ms, "
              f"p99 {ours['p99_ms']:.0f} ms; peak RSS {rss_peak:.0f} MiB (idle {rss_idle:.0f} MiB)")
        print(f"  direct   : all {floor['all_exist_s']:.1f} s, create->RayJob p50 {floor['p50_ms']:.0f} ms, "
              f"p99 {floor['p99_ms']:.0f} ms")
        print(f"  ratio (operator / direct): all-exist x{result['ratio_all_exist']}, p50 x{result['ratio_p50']}")
        print(json.dumps(result))
        return 0
    finally:
        if op is not None and op.poll() is None:
            os.kill(op.pid, signal.SIGTERM)
            try:
                op.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(op.pid, signal.SIGKILL)
                op.wait()
        cluster.stop()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
