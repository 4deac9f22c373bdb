#!/usr/bin/env python3
"""`make e2e-kind`: kora end to end on a real kind cluster, for machines with Docker and kind.

1. `kind create cluster` (its own kubeconfig in .kora/kind/, so your current context is untouched);
2. KubeRay's operator from its Helm chart (version pinned in hack/versions.env);
3. `docker build` of the operator and trainer images (Dockerfile targets), `kind load` of both;
4. `helm install kora charts/kora` with the freshly built operator image;
5. `kubectl apply` of the toy job — manifests/samples/toy-local.yaml as runtime KubeRay: a RayJob whose
   head pod runs the trainer on CPU (reference engine), the toy made on first use in an emptyDir;
6. wait until the job is Succeeded (progress printed as it changes), then `kubectl describe` it;
7. `kind delete cluster` (unless --keep).

Without `docker` or `kind` on PATH, or with no Docker engine answering, it says so and exits 0: kind
cannot run on the project's own development machines (no Docker engine), so there this is a skip,
not a failure. Everything else (`make test`, `make demo`) runs without Docker.

    python hack/e2e_kind.py [--keep] [--steps N] [--timeout S] [--print-job]

Environment: KORA_KIND_CLUSTER (default kora-e2e), KORA_KIND_NODE_IMAGE (kindest/node:<tag>; default:
kind's own), KORA_E2E_TRAINER_TARGET (the Dockerfile target of the trainer image, default trainer-cpu: kind has
no GPUs, and the toy runs on CPU with kora's reference engine; `trainer` builds the production SGLang image).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SAMPLE = ROOT / "manifests" / "samples" / "toy-local.yaml"
STATE = ROOT / ".kora" / "kind"
KUBERAY_CHART_REPO = "https://ray-project.github.io/kuberay-helm/"
OPERATOR_IMAGE = "kora-operator:e2e"
TRAINER_IMAGE = "kora-trainer:e2e"
TOY_IMAGE = "kora-trainer:e2e-toy"  # TRAINER_IMAGE plus the toy, made at build time by `kora make-toy`
TOY_DIR = "/opt/kora-toy"
CPU_TRAINER_TARGET = "trainer-cpu"  # the Dockerfile stage: no SGLang, the reference engine
JOB = "toy-kind"
NAMESPACE = "default"
FINAL = ("Succeeded", "Failed")


def log(msg: str) -> None:
    print(f"[e2e-kind {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def versions() -> dict[str, str]:
    out = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.startswith("#"):
            out[key.strip()] = value.strip()
    return out


def missing_prerequisite() -> str | None:
    """Why this machine cannot run the kind e2e, or None when it can."""
    for tool in ("docker", "kind"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          timeout=60, check=False)
    if info.returncode != 0:
        return f"no Docker engine answers `docker info`: {(info.stderr or info.stdout).strip()[:300]}"
    return None


def job_doc(steps: int) -> dict[str, Any]:
    """The demo's toy job, as a KubeRay job on kind: the trainer image, CPU only, data in an emptyDir."""
    import yaml  # the venv's (make setup): this script is run by `make e2e-kind`

    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = JOB
    spec = doc["spec"]
    spec.pop("runtime")  # the default, KubeRay: a RayJob per LoRATrainingJob
    spec["image"] = TOY_IMAGE
    # the toy is baked into TOY_IMAGE (kora make-toy); the emptyDir holds the checkpoints
    spec["model"] = {"path": TOY_DIR, "volume": {"emptyDir": {}, "mountPath": "/data"}}
    spec["data"]["path"] = f"{TOY_DIR}/train.parquet"
    spec["algorithm"]["numSteps"] = steps
    spec["checkpoint"]["path"] = "/data/checkpoints"
    spec["checkpoint"]["interval"] = max(1, steps // 2)
    spec["resources"] = {"workers": 0, "gpusPerWorker": 0, "headCpu": "2", "headMemory": "6Gi", "shmSize": "1Gi"}
    spec["ttlSecondsAfterFinished"] = 300
    return dict(doc)


class Kind:
    def __init__(self, name: str, bins: Path) -> None:
        self.name, self.bins = name, bins
        self.kubeconfig = STATE / "kubeconfig"
        self.env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def run(self, *cmd: str | Path, input: str | None = None, check: bool = True,
            capture: bool = False) -> subprocess.CompletedProcess[str]:
        shown = " ".join(str(c) for c in cmd)
        if not capture:
            log(f"$ {shown}")
        res = subprocess.run([str(c) for c in cmd], input=input, text=True, env=self.env, check=False,
                             capture_output=capture)
        if check and res.returncode != 0:
            raise SystemExit(f"failed ({res.returncode}): {shown}\n{res.stderr if capture else ''}")
        return res

    def kubectl(self, *args: str | Path, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run(self.bins / "kubectl", *args, **kw)

    def helm(self, *args: str | Path, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run(self.bins / "helm", *args, **kw)


def wait_job(k: Kind, timeout: float) -> str:
    """Print phase / step / reward whenever they change; return the final phase."""
    last, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = k.kubectl("get", "ltj", JOB, "-n", NAMESPACE, "-o", "json", check=False, capture=True)
        if res.returncode == 0:
            st = json.loads(res.stdout).get("status") or {}
            prog = st.get("progress") or {}
            row = (st.get("phase"), prog.get("step"), prog.get("totalSteps"), prog.get("rewardMean"))
            if row != last:
                log(f"{JOB}: phase {row[0]} step {row[1]}/{row[2]} reward {row[3]}")
                last = row
            if row[0] in FINAL:
                return str(row[0])
        time.sleep(5)
    raise SystemExit(f"{JOB} did not finish within {timeout:.0f} s (last: {last})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="leave the kind cluster running at the end")
    ap.add_argument("--steps", type=int, default=20, help="algorithm.numSteps of the toy job (default 20)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the job (image pulls included)")
    ap.add_argument("--print-job", action="store_true", help="print the LoRATrainingJob it applies, and exit")
    args = ap.parse_args(argv)
    import yaml

    doc = yaml.safe_dump(job_doc(args.steps), sort_keys=False)
    if args.print_job:
        print(doc, end="")
        return 0
    why = missing_prerequisite()
    if why:
        print(f"e2e-kind: SKIPPED — {why}. It needs Docker and kind (https://kind.sigs.k8s.io); "
              "`make test` and `make demo` run the same operator and trainer without them.", flush=True)
        return 0
    v = versions()
    name = os.environ.get("KORA_KIND_CLUSTER", "kora-e2e")
    bins = Path(subprocess.run(["bash", str(HERE / "testbin.sh")], capture_output=True, text=True, check=True)
                .stdout.strip().splitlines()[-1])  # the pinned kubectl and helm
    STATE.mkdir(parents=True, exist_ok=True)
    k = Kind(name, bins)
    t0 = time.monotonic()
    created = False
    try:
        if name in k.run("kind", "get", "clusters", capture=True).stdout.split():
            log(f"kind cluster {name} exists: reusing it")
            k.run("kind", "export", "kubeconfig", "--name", name, "--kubeconfig", k.kubeconfig)
        else:
            node = os.environ.get("KORA_KIND_NODE_IMAGE")
            k.run("kind", "create", "cluster", "--name", name, "--kubeconfig", k.kubeconfig, "--wait", "180s",
                  *(["--image", node] if node else []))
            created = True
        kuberay = v["KUBERAY_VERSION"].removeprefix("v")
        k.helm("upgrade", "--install", "kuberay-operator", "kuberay-operator", "--repo", KUBERAY_CHART_REPO,
               "--version", kuberay, "--namespace", "kuberay-system", "--create-namespace", "--wait",
               "--timeout", "10m")
        target = os.environ.get("KORA_E2E_TRAINER_TARGET", CPU_TRAINER_TARGET)
        k.run("docker", "build", "--target", "operator", "-t", OPERATOR_IMAGE, ROOT)
        k.run("docker", "build", "--target", target, "-t", TRAINER_IMAGE, ROOT)
        k.run("docker", "build", "-t", TOY_IMAGE, "-", input=f"FROM {TRAINER_IMAGE}\nRUN kora make-toy {TOY_DIR}\n")
        k.run("kind", "load", "docker-image", OPERATOR_IMAGE, TOY_IMAGE, "--name", name)
        repo, tag = OPERATOR_IMAGE.split(":")
        k.helm("upgrade", "--install", "kora", ROOT / "charts" / "kora", "--namespace", "kora-system",
               "--create-namespace", "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
               "--set", "image.pullPolicy=Never", "--wait", "--timeout", "5m")
        k.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=doc)
        phase = wait_job(k, args.timeout)
        print(k.kubectl("describe", "ltj", JOB, "-n", NAMESPACE, capture=True).stdout, flush=True)
        if phase != "Succeeded":
            k.kubectl("get", "rayjobs,rayclusters,pods", "-n", NAMESPACE, "-o", "wide", check=False)
            k.kubectl("logs", "-n", "kora-system", "deploy/kora", "--tail=100", check=False)
            log(f"{JOB} {phase}")
            return 1
        log(f"{JOB} Succeeded after {time.monotonic() - t0:.0f} s (cluster set-up and image builds included)")
        return 0
    finally:
        if created and not args.keep:
            k.run("kind", "delete", "cluster", "--name", name, check=False)
        elif args.keep:
            log(f"kept kind cluster {name}; KUBECONFIG={k.kubeconfig}; `kind delete cluster --name {name}` removes it")


if __name__ == "__main__":
    raise SystemExit(main())
