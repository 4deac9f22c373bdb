#!/usr/bin/env python3
"""`make demo`: the whole kora experience on this machine, then clean up.

1. a real control plane (etcd + kube-apiserver + kube-controller-manager on 127.0.0.1) and kora's CRDs;
2. a local Ray head on 127.0.0.1 (runtime Ray: the operator submits through its Jobs API);
3. the kora operator (`kora operator`), as a process of its own;
4. `kubectl apply` of manifests/samples/toy-local.yaml (the toy task on CPU), with the Ray address
   filled in; progress is streamed like `kubectl get ltj -w`;
5. `kubectl describe ltj toy-local` of the finished job (checkpoints and the HF-PEFT adapter in
   .kora/demo/checkpoints/, made afresh each run);
6. the reward curve in the terminal and .kora/demo/reward_sync.png (reward and sync time per step), both read
   from the job's TensorBoard event files in .kora/demo/tensorboard (hack/demo_report.py);
and every process it started is stopped by pid at the end, whatever happened.

    python hack/demo.py [--steps N] [--timeout SECONDS] [--keep-going]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from demo_report import report  # noqa: E402
from localcluster import LocalCluster, free_ports, wait_for  # noqa: E402
from localray import LocalRay  # noqa: E402

STATE = ROOT / ".kora" / "demo"
SAMPLE = ROOT / "manifests" / "samples" / "toy-local.yaml"
TOY = ROOT / ".kora" / "toy"  # the sample's model.path, relative to the Ray job's working directory (ROOT)
CHECKPOINTS = STATE / "checkpoints"
TENSORBOARD = STATE / "tensorboard"
PICTURE = STATE / "reward_sync.png"
FINAL = ("Succeeded", "Failed")


def log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start_operator(cluster: LocalCluster, ray: LocalRay, namespace: str) -> subprocess.Popen[bytes]:
    live, metrics = free_ports(2)
    kora = Path(sys.executable).with_name("kora")
    env = {**os.environ, **cluster.env(), **ray.env(), "KORA_OPERATOR_KEY_FILE": str(STATE / "operator-key")}
    cmd = [
        str(kora),
        "operator",
        "--namespace",
        namespace,
        "--liveness",
        f"http://127.0.0.1:{live}/healthz",
        "--metrics-port",
        str(metrics),
        "--metrics-address",
        "127.0.0.1",
        "--poll-interval",
        "2",
        "--trainer-command",
        f"{sys.executable} -m kora_trainer.train",
    ]
    out = open(STATE / "operator.log", "wb")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def job_doc(address: str, steps: int | None) -> str:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["spec"]["runtime"]["address"] = address
    # the demo's own checkpoints, fresh each time: the sample's path would hold the last demo's final
    # checkpoint, and the trainer would resume from it (with nothing left to train)
    doc["spec"]["checkpoint"]["path"] = str(CHECKPOINTS)
    doc["spec"].setdefault("tracking", {})["tensorboard"] = {"logDir": str(TENSORBOARD)}  # fresh each run too
    if steps:
        doc["spec"]["algorithm"]["numSteps"] = steps
    return yaml.safe_dump(doc)


def watch(cluster: LocalCluster, namespace: str, timeout: float) -> dict:
    """Print a line whenever phase/step/reward change (like `kubectl get ltj -w`); return the final object."""
    header = f"{'NAME':<10} {'MODE':<8} {'PHASE':<13} {'STEP':>9} {'REWARD':>7}  SYNCED"
    print(header, flush=True)
    last, deadline, obj = None, time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        res = cluster.kubectl("get", "ltj", "toy-local", "-n", namespace, "-o", "json", check=False)
        if res.returncode == 0:
            obj = json.loads(res.stdout)
            st = obj.get("status") or {}
            prog = st.get("progress") or {}
            sync = (prog.get("lastSync") or {}).get("adapterVersion")
            reward = prog.get("rewardMean")
            row = (
                st.get("syncMode") or "",
                st.get("phase") or "",
                f"{prog.get('step', '')}/{prog.get('totalSteps', '')}",
                "" if reward is None else f"{reward:.3f}",
                "" if sync is None else f"v{sync}",
            )
            if row != last:
                print(f"{'toy-local':<10} {row[0]:<8} {row[1]:<13} {row[2]:>9} {row[3]:>7}  {row[4]}", flush=True)
                last = row
            if st.get("phase") in FINAL:
                return obj
        time.sleep(2)
    raise TimeoutError(f"toy-local did not finish within {timeout:.0f} s (phase {last[1] if last else '?'})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="override algorithm.numSteps (default: the sample's)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds to wait for the job to finish")
    ap.add_argument("--namespace", default="default")
    args = ap.parse_args(argv)
    STATE.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(CHECKPOINTS, ignore_errors=True)
    shutil.rmtree(TENSORBOARD, ignore_errors=True)
    t0 = time.monotonic()
    cluster = ray = operator = None
    try:
        if not TOY.exists():
            log(f"kora make-toy {TOY.relative_to(ROOT)}: the toy model, tokenizer and dataset the job trains on")
            from kora_trainer.toys.lm import make_toy

            make_toy(TOY)
        log("starting etcd + kube-apiserver + kube-controller-manager on 127.0.0.1")
        cluster = LocalCluster.start(STATE / "cluster")
        cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "manifests" / "crds"))
        cluster.kubectl("wait", "--for=condition=Established", "crd/loratrainingjobs.kora.dev", "--timeout=60s")
        log("starting a local Ray head on 127.0.0.1")
        ray = LocalRay.start(num_cpus=2, cwd=ROOT, log=STATE / "ray.log")
        log(f"Ray Jobs API at {ray.dashboard_url}; starting the kora operator (log {STATE / 'operator.log'})")
        operator = start_operator(cluster, ray, args.namespace)
        wait_for(
            lambda: cluster.kubectl("get", "ltj", "-n", args.namespace, check=False).returncode == 0,
            timeout=60,
            interval=0.5,
            what="the LoRATrainingJob API",
        )
        log(f"kubectl apply -f {SAMPLE.relative_to(ROOT)}  (runtime.address={ray.dashboard_url})")
        print(
            cluster.kubectl(
                "apply", "-n", args.namespace, "-f", "-", input=job_doc(ray.dashboard_url, args.steps)
            ).stdout.strip(),
            flush=True,
        )
        final = watch(cluster, args.namespace, args.timeout)
        print(flush=True)
        log("kubectl describe ltj toy-local")
        print(cluster.kubectl("describe", "ltj", "toy-local", "-n", args.namespace).stdout, flush=True)
        phase = final["status"]["phase"]
        adapter = CHECKPOINTS / "lora_adapter"
        if (adapter / "adapter_config.json").exists():
            log(f"the trained adapter (HF PEFT): {adapter.relative_to(ROOT)}; LoRA-only checkpoints beside it")
        if phase == "Succeeded":
            print(report(TENSORBOARD, PICTURE), flush=True)
        log(f"{phase} after {time.monotonic() - t0:.0f} s wall (set-up included)")
        return 0 if phase == "Succeeded" else 1
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
