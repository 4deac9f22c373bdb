#!/usr/bin/env python3
"""`make demo-multi`: a multi-adapter service on this machine, driven with kubectl, then clean up.

1. the control plane, a local Ray head and the kora operator, as `make demo` starts them (hack/demo.py);
2. `kubectl apply` of manifests/samples/toy-multi-lora.yaml: a service (no adapters of its own) that idles until
   adapters name it;
3. `kubectl apply` of two LoRAAdapters of manifests/samples/adapters/toy-multi.yaml with different data (`add`:
   all sums; `small`: the sums of numbers below 20, at a smaller rank); a third (`late`) once the others train;
   `small` deleted mid-run (its requests aborted, its checkpoint and export written, its slot freed);
4. `kubectl get lad` streamed meanwhile (each adapter's phase, step, reward and served version), until `add` and
   `late` have Succeeded; then the job is deleted, which deletes its adapters;
and every process it started is stopped by pid at the end, whatever happened.

    python hack/demo_multi.py [--timeout SECONDS] [--namespace NS]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from demo import ROOT, STATE, TOY, log, start_operator, stop  # noqa: E402
from localcluster import LocalCluster, wait_for  # noqa: E402
from localray import LocalRay  # noqa: E402

SAMPLE = ROOT / "manifests" / "samples" / "toy-multi-lora.yaml"
ADAPTERS = ROOT / "manifests" / "samples" / "adapters" / "toy-multi.yaml"
CHECKPOINTS = STATE / "checkpoints-multi"
COLUMNS = ("phase", "slot", "step", "numSteps", "rewardMean", "version")


def docs(address: str) -> dict[str, str]:
    """The sample's objects as YAML by name: the job (its Ray address and a fresh checkpoint path) and adapters."""
    out = {}
    for doc in [*yaml.safe_load_all(SAMPLE.read_text()), *yaml.safe_load_all(ADAPTERS.read_text())]:
        if doc["kind"] == "LoRATrainingJob":
            doc["spec"]["runtime"]["address"] = address
            doc["spec"]["checkpoint"]["path"] = str(CHECKPOINTS)
        out[doc["metadata"]["name"]] = yaml.safe_dump(doc)
    return out


def adapters(cluster: LocalCluster, namespace: str) -> dict[str, dict]:
    res = cluster.kubectl("get", "lad", "-n", namespace, "-o", "json", check=False)
    if res.returncode != 0:
        return {}
    return {o["metadata"]["name"]: o.get("status") or {} for o in json.loads(res.stdout)["items"]}


class Table:
    """Prints a row whenever an adapter's phase, step, reward or version changes (like `kubectl get lad -w`)."""

    def __init__(self) -> None:
        self.last: dict[str, tuple] = {}
        print(f"{'ADAPTER':<8} {'PHASE':<10} {'SLOT':>4} {'STEP':>9} {'REWARD':>7} {'VERSION':>7}", flush=True)

    def show(self, states: dict[str, dict]) -> None:
        for name, st in sorted(states.items()):
            row = tuple(st.get(k) for k in COLUMNS)
            if row != self.last.get(name):
                phase, slot, step, total, reward, version = row
                print(f"{name:<8} {phase or '':<10} {'' if slot is None else slot:>4} "
                      f"{f'{step or 0}/{total or chr(63)}':>9} {'' if reward is None else f'{reward:.3f}':>7} "
                      f"{'' if version is None else f'v{version}':>7}", flush=True)
                self.last[name] = row


def follow(cluster: LocalCluster, namespace: str, table: Table, until, timeout: float, what: str) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = adapters(cluster, namespace)
        table.show(states)
        if until(states):
            return states
        time.sleep(1)
    raise TimeoutError(f"{what} within {timeout:.0f} s")


def run_demo(cluster: LocalCluster, ray: LocalRay, namespace: str, timeout: float) -> int:
    objects = docs(ray.dashboard_url)

    def apply(name: str) -> None:
        log(f"kubectl apply {name}")
        print(cluster.kubectl("apply", "-n", namespace, "-f", "-", input=objects[name]).stdout.strip(), flush=True)

    apply("toy-multi")
    for name in ("add", "small"):
        apply(name)
    table = Table()

    def training(*names: str):
        return lambda s: all((s.get(n) or {}).get("phase") == "Training" and (s[n].get("step") or 0) >= 5
                             for n in names)

    follow(cluster, namespace, table, training("add", "small"), timeout, "add and small never trained")
    apply("late")
    follow(cluster, namespace, table, training("late"), timeout, "late never trained")
    log("kubectl delete lad small  (mid-run: its requests aborted, its checkpoint and export written)")
    cluster.kubectl("delete", "lad", "small", "-n", namespace, "--wait=true", "--timeout=120s")
    done = follow(cluster, namespace, table,
                  lambda s: all((s.get(n) or {}).get("phase") in ("Succeeded", "Failed") for n in ("add", "late")),
                  timeout, "add and late did not finish")
    for name in ("add", "small", "late"):
        export = CHECKPOINTS / "adapters" / name / "lora_adapter"
        if (export / "adapter_config.json").exists():
            log(f"{name}: HF-PEFT export in {export.relative_to(ROOT)}")
    log("kubectl get lad")
    print(cluster.kubectl("get", "lad", "-n", namespace).stdout, flush=True)
    log("kubectl delete ltj toy-multi  (its adapters go with it)")
    cluster.kubectl("delete", "ltj", "toy-multi", "-n", namespace, "--wait=true", "--timeout=120s")
    wait_for(lambda: not adapters(cluster, namespace), timeout=120, interval=1,
             what="the adapters deleted with the job")
    log("no LoRAAdapter left")
    return 0 if all(done[n].get("phase") == "Succeeded" for n in ("add", "late")) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=900, help="seconds for each stage of the demo")
    ap.add_argument("--namespace", default="default")
    args = ap.parse_args(argv)
    STATE.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(CHECKPOINTS, ignore_errors=True)
    t0 = time.monotonic()
    cluster = ray = operator = None
    try:
        if not (TOY / "small.parquet").exists():
            log(f"kora make-toy {TOY.relative_to(ROOT)}: the toy model, tokenizer and datasets the adapters train on")
            from kora_trainer.toys.lm import make_toy

            make_toy(TOY)
        log("starting etcd + kube-apiserver + kube-controller-manager on 127.0.0.1")
        cluster = LocalCluster.start(STATE / "cluster")
        cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "manifests" / "crds"))
        # the CRDs' APIs served (a `kubectl wait` on a CRD that has no conditions yet fails at once)
        wait_for(lambda: cluster.kubectl("get", "ltj,lad", "-A", check=False).returncode == 0, timeout=60,
                 interval=0.5, what="the kora CRDs established")
        log("starting a local Ray head on 127.0.0.1")
        ray = LocalRay.start(num_cpus=2, cwd=ROOT, log=STATE / "ray.log")
        log(f"Ray Jobs API at {ray.dashboard_url}; starting the kora operator (log {STATE / 'operator.log'})")
        operator = start_operator(cluster, ray, args.namespace)
        wait_for(lambda: cluster.kubectl("get", "lad", "-n", args.namespace, check=False).returncode == 0,
                 timeout=60, interval=0.5, what="the LoRAAdapter API")
        code = run_demo(cluster, ray, args.namespace, args.timeout)
        log(f"{'done' if code == 0 else 'FAILED'} after {time.monotonic() - t0:.0f} s wall (set-up included)")
        return code
    finally:
        log("cleaning up: operator, Ray head, control plane")
        if cluster is not None and operator is not None:
            cluster.kubectl("delete", "ltj", "--all", "-n", args.namespace, "--wait=true", "--timeout=60s", check=False)
        stop(operator)
        if ray is not None:
            ray.stop()
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
