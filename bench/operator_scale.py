#!/usr/bin/env python3
"""How fast does the operator turn N LoRATrainingJobs into RayJobs, against the floor of creating
the same N RayJobs directly through the API?

    python bench/operator_scale.py [--n 500] [--concurrency 8]

Starts its own local control plane (hack/localcluster.py: etcd + kube-apiserver +
kube-controller-manager on 127.0.0.1) with our CRDs and KubeRay's, and runs `kora operator` as a
subprocess. Both runs create their N objects the same way (the Python client, `--concurrency`
threads) while one watch per run records when each RayJob appears.

Prints: per-object latency from create to RayJob seen (p50/p99), time until all N exist, the
operator's peak RSS and CPU seconds, the same for N RayJobs created directly (the floor), the ratios
against issue 18's targets (all within 3x the floor's all-exist time, p99 within 3x it, RSS <= 250 MiB),
and the API requests per job (the kube-apiserver's own apiserver_request_total, by verb and resource,
counted from the first create until every job shows Pending and the operator has posted every Event it queued:
it posts them behind its other writes, kora_operator/events.py; the seconds until then are printed too); then
restarts the operator once over the N jobs and prints the requests per job its resume sweep made and how long it
took. Writes bench/results/operator_scale_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
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
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "hack"))

from kubernetes import client, config, watch  # noqa: E402

from localcluster import LocalCluster, free_ports, wait_for  # noqa: E402

KORA = Path(sys.executable).with_name("kora")
TARGET_ALL_EXIST, TARGET_P99, TARGET_RSS_MIB = 3.0, 3.0, 250.0  # issue 18 item 5


def job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kora.dev/v1alpha1", "kind": "LoRATrainingJob", "metadata": {"name": name},
        "spec": {"model": {"path": "/models/tiny", "volume": {"hostPath": {"path": "/tmp"}}},
                 "lora": {"rank": 8, "syncMode": "Merge"}, "data": {"path": "/data/train.parquet"}},
    }


def watch_rayjobs(api: Any, ns: str, n: int, seen: dict[str, float], done: threading.Event) -> None:
    """Record the local time each RayJob in `ns` is first seen, until n were seen.

    A watch the API server ends early (its watch cache re-initialising under load does that) is opened again;
    a new watch starts with every existing RayJob as ADDED, so one made while none was open is stamped late
    (its latency overstated, never understated)."""
    deadline = time.monotonic() + 600
    while len(seen) < n and time.monotonic() < deadline:
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
        "t0": t0,
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


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a living process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def others_cpu_s(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds so far of etcd, kube-controller-manager and this bench (its creating threads and its watch): the
    rest of what shares the machine's cores with the API server and the operator."""
    got = {name.replace("-", "_"): cpu_s(pid) for name, pid in cluster.pids.items()
           if name in ("etcd", "kube-controller-manager")}
    mine = os.times()
    got["bench"] = mine.user + mine.system
    return got


def api_requests(cluster: LocalCluster) -> tuple[Counter[str], Counter[str]]:
    """The API server's request counts so far and the seconds spent answering them (its request-duration
    histogram's sum, in ms), by "VERB resource[/subresource]" (all clients, all codes; WATCH excluded: a watch
    lasts as long as it is open)."""
    counts: Counter[str] = Counter()
    ms: Counter[str] = Counter()
    for line in cluster.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        metric = line.split("{", 1)[0]
        if metric not in ("apiserver_request_total", "apiserver_request_duration_seconds_sum"):
            continue
        labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.rindex("}")].split(","))
        labels = {k: v.strip('"') for k, v in labels.items()}
        if labels.get("verb") == "WATCH":
            continue
        resource = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
        value = float(line.rsplit(" ", 1)[1])
        key = f"{labels.get('verb')} {resource}"
        if metric == "apiserver_request_total":
            counts[key] += int(value)
        else:
            ms[key] += int(1000 * value)
    return counts, ms


def created_at(api: Any, ns: str, group: str, version: str, plural: str) -> dict[str, dt.datetime]:
    items = api.list_namespaced_custom_object(group, version, ns, plural)["items"]
    return {i["metadata"]["name"]: dt.datetime.fromisoformat(i["metadata"]["creationTimestamp"]) for i in items}


def server_view(api: Any, ns: str, jobs: bool) -> dict[str, float]:
    """The same figures on the API server's clock (creationTimestamps, whole seconds), without the bench's watch
    in the way (under load its events arrive late): all-exist = last RayJob - first object created; with `jobs`,
    per job its RayJob's creationTimestamp minus its own (p99, max)."""
    rays = created_at(api, ns, "ray.io", "v1", "rayjobs")
    if not jobs:
        return {"server_all_exist_s": (max(rays.values()) - min(rays.values())).total_seconds()}
    made = created_at(api, ns, "kora.dev", "v1alpha1", "loratrainingjobs")
    lags = sorted((rays[f"{k}-ray"] - v).total_seconds() for k, v in made.items() if f"{k}-ray" in rays)
    return {"server_all_exist_s": (max(rays.values()) - min(made.values())).total_seconds(),
            "server_lag_p99_s": lags[min(len(lags) - 1, int(0.99 * len(lags)))], "server_lag_max_s": lags[-1]}


def all_pending(api: Any, ns: str, n: int) -> bool:
    items = api.list_namespaced_custom_object("kora.dev", "v1alpha1", ns, "loratrainingjobs")["items"]
    return sum((i.get("status") or {}).get("phase") == "Pending" for i in items) >= n


def events_queued(metrics_port: int) -> float:
    """The Events the operator has handed to its poster and not yet posted, and the job statuses handed to its
    status writer and not yet written (whose transitions' Events are handed over once they are): 0 for an operator
    that posts and writes them itself, which has no such gauges."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("kora_events_queued ", "kora_status_writes_pending ")))


def start_operator(args: argparse.Namespace, cluster: LocalCluster, mode: str
                   ) -> tuple[subprocess.Popen[bytes], float, int]:
    """`kora operator` on the bench namespace, its log appended to --keep-logs (`mode` "wb" truncates it first);
    returns it once live, the seconds that took, and its metrics port."""
    liveness, metrics = free_ports(2)
    Path(args.keep_logs).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(args.keep_logs, mode) as log:
        op = subprocess.Popen(
            [str(KORA), "operator", "--namespace", "bench-operator", "--liveness",
             f"http://127.0.0.1:{liveness}/healthz", "--metrics-port", str(metrics), "--metrics-address",
             "127.0.0.1"], env=cluster.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=2).status == 200,
             timeout=60, what="operator liveness")
    return op, time.monotonic() - t0, metrics


def stop_operator(op: subprocess.Popen[bytes]) -> None:
    if op.poll() is None:
        os.kill(op.pid, signal.SIGTERM)
        try:
            op.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(op.pid, signal.SIGKILL)
            op.wait()


def restart(args: argparse.Namespace, cluster: LocalCluster, op: subprocess.Popen[bytes]
            ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Stop the operator and start it again over the N reconciled jobs: the API requests per job its resume sweep
    makes (each job's resume, and each RayJob's event from kopf's first listing), and the seconds from its start
    until it is live (kopf's own start, the anchor) and until both have run for every job (kopf's log says so)."""
    stop_operator(op)
    log = Path(args.keep_logs)
    offset = log.stat().st_size
    requests0, _ = api_requests(cluster)
    t0 = time.monotonic()
    op, live_s, _ = start_operator(args, cluster, "ab")

    def swept() -> bool:
        with open(log, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
        return (text.count("Resuming is processed") >= args.n
                and text.count("Handler 'ray_job_changed' succeeded") >= args.n)

    wait_for(swept, timeout=300, interval=0.05, what="every job resumed and every RayJob's first event handled")
    all_s = time.monotonic() - t0
    requests = api_requests(cluster)[0] - requests0
    return op, {"live_s": round(live_s, 2), "all_resumed_s": round(all_s, 2),
                "api_requests_per_job": round(sum(requests.values()) / args.n, 2),
                "api_requests_per_job_by_kind": {k: round(v / args.n, 2) for k, v in sorted(requests.items())
                                                 if v >= 0.05 * args.n}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="jobs to create (default 500)")
    parser.add_argument("--concurrency", type=int, default=8, help="client threads creating objects")
    parser.add_argument("--keep-logs", default="/tmp/kora-logs/operator-scale.log", help="operator log file")
    parser.add_argument("--out", default=str(ROOT / f"bench/results/operator_scale_{dt.date.today()}.json"),
                        help="result file (empty: none)")
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

        apiserver = cluster.pids["kube-apiserver"]
        api_cpu0, others0 = cpu_s(apiserver), others_cpu_s(cluster)
        floor = run(api, "bench-direct", args.n, args.concurrency, direct)
        cpu_api_floor = cpu_s(apiserver) - api_cpu0
        others_floor = {f"{k}_direct": v - others0[k] for k, v in others_cpu_s(cluster).items()}

        op, _, metrics_port = start_operator(args, cluster, "wb")
        rss_idle, cpu_idle = peak_rss_mib(op.pid), cpu_s(op.pid)
        api_cpu0, (requests0, ms0), others0 = cpu_s(apiserver), api_requests(cluster), others_cpu_s(cluster)

        def via_operator(i: int) -> str:
            api.create_namespaced_custom_object("kora.dev", "v1alpha1", "bench-operator", "loratrainingjobs",
                                                job(f"job-{i}"))
            return f"job-{i}-ray"

        ours = run(api, "bench-operator", args.n, args.concurrency, via_operator)
        rss_peak, cpu_op = peak_rss_mib(op.pid), cpu_s(op.pid) - cpu_idle
        cpu_api = cpu_s(apiserver) - api_cpu0
        others = {k: v - others0[k] for k, v in others_cpu_s(cluster).items()}
        # the rest of each job's first reconcile (its status, its Events) happens after its RayJob: count it too
        wait_for(lambda: all_pending(api, "bench-operator", args.n), timeout=300, what="every job Pending")
        wait_for(lambda: events_queued(metrics_port) == 0, timeout=300, interval=0.1, what="every Event posted")
        ours["all_done_s"] = time.monotonic() - ours["t0"]
        cpu_done = cpu_s(op.pid) - cpu_idle
        requests, ms = api_requests(cluster)
        ours.update(server_view(api, "bench-operator", jobs=True))
        floor.update(server_view(api, "bench-direct", jobs=False))
        for r in (ours, floor):
            r.pop("t0")
        result = summary(args, ours, floor, rss_idle, rss_peak, {"operator": cpu_op, "kube_apiserver": cpu_api,
                                                                 "kube_apiserver_direct": cpu_api_floor,
                                                                 "operator_until_done": cpu_done, **others,
                                                                 **others_floor},
                         requests - requests0, ms - ms0)
        op, result["restart"] = restart(args, cluster, op)
        print(table(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {args.out}")
        return 0
    finally:
        if op is not None:
            stop_operator(op)
        cluster.stop()
        shutil.rmtree(state, ignore_errors=True)


def summary(args: argparse.Namespace, ours: dict[str, float], floor: dict[str, float], rss_idle: float,
            rss_peak: float, cpu: dict[str, float], requests: Counter[str], ms: Counter[str]) -> dict[str, Any]:
    ratio_all = ours["all_exist_s"] / floor["all_exist_s"]
    ratio_p99 = ours["p99_ms"] / 1000 / floor["all_exist_s"]
    return {
        "date": str(dt.date.today()), "n": args.n, "concurrency": args.concurrency, "cpus": os.cpu_count(),
        "operator": {k: round(v, 1) for k, v in ours.items()},
        "direct_floor": {k: round(v, 1) for k, v in floor.items()},
        "operator_rss_mib": {"idle": round(rss_idle, 1), "peak": round(rss_peak, 1)},
        # until every RayJob exists: the operator's, the API server's, etcd's, kube-controller-manager's and this
        # bench's (`_direct`: in the direct run); and the operator's until every job was Pending and every Event posted
        "cpu_s": {k: round(v, 1) for k, v in cpu.items()},
        # how much of the machine those processes took until every RayJob existed (the rest: other work on it)
        "cores_busy": {
            run: round(sum(v for k, v in cpu.items() if k.endswith("_direct") == (run == "direct")
                           and k != "operator_until_done") / ((os.cpu_count() or 1) * times["all_exist_s"]), 2)
            for run, times in (("operator", ours), ("direct", floor))},
        "ratio_all_exist": round(ratio_all, 2),
        "ratio_p99_to_floor_all_exist": round(ratio_p99, 2),
        "ratio_p50": round(ours["p50_ms"] / floor["p50_ms"], 2),
        "targets": {"all_exist": TARGET_ALL_EXIST, "p99": TARGET_P99, "rss_mib": TARGET_RSS_MIB},
        "met": {"all_exist": ratio_all <= TARGET_ALL_EXIST, "p99": ratio_p99 <= TARGET_P99,
                "rss": rss_peak <= TARGET_RSS_MIB},
        # the bench's own creates are in here too (POST loratrainingjobs: n) and its watch and lists
        "api_requests_per_job": {k: round(v / args.n, 2) for k, v in sorted(requests.items()) if v},
        "api_requests_total": sum(requests.values()),
        # the API server's answer time per job (wall, all requests in flight together: where it waits, not CPU)
        "api_ms_per_job": {k: round(v / args.n, 1) for k, v in sorted(ms.items()) if v},
    }


def table(r: dict[str, Any]) -> str:
    op, fl, met = r["operator"], r["direct_floor"], r["met"]
    ok = {True: "yes", False: "NO"}
    rows = [
        f"N={r['n']} (concurrency {r['concurrency']}, {r['cpus']} CPUs)",
        f"{'':28}{'operator':>12}{'direct':>12}{'ratio':>9}{'target':>9}{'met':>6}",
        f"{'all RayJobs exist (s)':28}{op['all_exist_s']:>12.1f}{fl['all_exist_s']:>12.1f}"
        f"{r['ratio_all_exist']:>9.2f}{'<= 3x':>9}{ok[met['all_exist']]:>6}",
        f"{'create->RayJob p99 (ms)':28}{op['p99_ms']:>12.0f}{fl['p99_ms']:>12.0f}"
        f"{r['ratio_p99_to_floor_all_exist']:>9.2f}{'<= 3x*':>9}{ok[met['p99']]:>6}",
        f"{'create->RayJob p50 (ms)':28}{op['p50_ms']:>12.0f}{fl['p50_ms']:>12.0f}{r['ratio_p50']:>9.1f}",
        f"{'operator peak RSS (MiB)':28}{r['operator_rss_mib']['peak']:>12.0f}{'':>21}{'<= 250':>9}"
        f"{ok[met['rss']]:>6}",
        f"{'kube-apiserver CPU s':28}{r['cpu_s']['kube_apiserver']:>12.1f}{r['cpu_s']['kube_apiserver_direct']:>12.1f}",
        f"{'operator CPU s':28}{r['cpu_s']['operator']:>12.1f}",
        *(f"{name + ' CPU s':28}{r['cpu_s'][key]:>12.1f}{r['cpu_s'][key + '_direct']:>12.1f}"
          for name, key in (("etcd", "etcd"), ("kube-controller-manager", "kube_controller_manager"),
                            ("this bench", "bench")) if key in r["cpu_s"]),
        f"{'all of the above, of the cores':28}{r['cores_busy']['operator']:>11.0%}{r['cores_busy']['direct']:>12.0%}"
        "  (their CPU over cores x all-exist time: below 100% the machine was shared)",
        f"{'every job Pending, every Event posted (s)':44}{op['all_done_s']:>7.1f}  (operator CPU until then "
        f"{r['cpu_s']['operator_until_done']:.1f} s)",
        "  * p99 against the direct floor's all-exist time",
        f"  on the API server's clock (creationTimestamps, 1 s): all exist {op['server_all_exist_s']:.0f} s vs "
        f"{fl['server_all_exist_s']:.0f} s direct; job -> RayJob p99 {op['server_lag_p99_s']:.0f} s, "
        f"max {op['server_lag_max_s']:.0f} s",
        f"API requests per job ({r['api_requests_total']} in all, the bench's own included):",
    ]
    rows[-1] += "  (and answer ms per job)"
    rows += [f"  {k:44}{v:>7.2f}{r['api_ms_per_job'].get(k, 0):>9.1f}"
             for k, v in r["api_requests_per_job"].items() if v >= 0.05]
    if "restart" in r:
        sweep = r["restart"]
        rows.append(f"a restart over the {r['n']} jobs: live {sweep['live_s']:.2f} s, every job resumed "
                    f"{sweep['all_resumed_s']:.2f} s after its start; {sweep['api_requests_per_job']:.2f} API requests "
                    "per job:")
        rows += [f"  {k:44}{v:>7.2f}" for k, v in sweep["api_requests_per_job_by_kind"].items()]
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
