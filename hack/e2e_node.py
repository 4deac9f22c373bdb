#!/usr/bin/env python3
"""`make e2e-node`: kora end to end on a real Kubernetes node of ours — our images in pods, no Docker, no registry.

1. `hack/images.py`: the operator and trainer-cpu images from the Dockerfile (buildah; warm: seconds), as archives;
2. `hack/localcluster.py up --node`: etcd + kube-apiserver + kube-controller-manager + a real node (containerd,
   kubelet, kube-proxy, kube-scheduler, CoreDNS) in <dir> (default .kora/e2e-node);
3. the images imported into the node's containerd, with a third one made here: KubeRay's operator, the binary
   hack/testbin.sh builds in an image FROM scratch (`kora.local/kuberay-operator:<KUBERAY_VERSION>`);
4. KubeRay's operator as a pod (namespace kuberay-system): its CRDs and ClusterRole from its Go module, a
   ServiceAccount and binding of ours, the labels its Helm chart gives it (the ones charts/kora's NetworkPolicy names);
5. `helm install kora charts/kora` with our operator image (the chart's RBAC, securityContext, NetworkPolicy);
6. the toy on a hostPath PersistentVolume (`kora make-toy`, manifests/samples/volumes/toy-kuberay-pv.yaml), then
   `kubectl apply -f manifests/samples/toy-kuberay.yaml`: RayJob -> RayCluster -> head pod on the trainer image;
7. wait for Succeeded (the step printed as it climbs), then `kubectl get ltj`, `kubectl describe ltj` and the
   trainer's progress lines from `kubectl logs`; with --kill-head the head pod is deleted (force, grace 0) once a
   checkpoint is on the volume: KubeRay retries, the trainer resumes from it;
8. `hack/localcluster.py down` (unless --keep): nothing of ours is left (bridge, iptables chains, mounts, cgroups).

    python hack/e2e_node.py [--dir .kora/e2e-node] [--steps N] [--kill-head] [--keep] [--pods-out FILE]

Needs root and what `make setup` installs (hack/install_tools.sh): containerd, runc, CNI plugins, iptables, gcc,
buildah, podman, debootstrap; and the pinned binaries (hack/testbin.sh, --node). The Python API (`E2ENode`) is what
tests/e2e/test_e2e_node.py drives.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import images
import localnode
import nettrace
from localcluster import LocalCluster, provide_binaries, read_versions, wait_for
from ociimage import ImageFile, write_oci_archive

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SAMPLE = ROOT / "manifests" / "samples" / "toy-kuberay.yaml"
VOLUME_SAMPLE = ROOT / "manifests" / "samples" / "volumes" / "toy-kuberay-pv.yaml"
TOY_CACHE = ROOT / ".kora" / "toy"  # hack/demo.py's toy (the same `kora make-toy`), copied onto the volume
JOB = "toy-kuberay"
NAMESPACE = "default"
KORA_NAMESPACE = "kora-system"
KUBERAY_NAMESPACE = "kuberay-system"
# the labels of KubeRay's Helm chart: charts/kora's networkPolicy.kuberay.podLabels default selects them
KUBERAY_LABELS = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/instance": "kuberay-operator"}
RAY_USER = 1000  # builders/rayjob.py RUN_AS: the Ray pods' uid, which must write the hostPath volume
FINAL = ("Succeeded", "Failed")
COMPONENT_LABEL = "kora.dev/component"  # builders/meta.py: the submitter pod is ray-submitter


def log(msg: str) -> None:
    print(f"[e2e-node {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def kuberay_image_name() -> str:
    return f"kora.local/kuberay-operator:{read_versions()['KUBERAY_VERSION']}"


def kuberay_module_dir() -> Path:
    """KubeRay's ray-operator module in Go's module cache (hack/testbin.sh downloaded it to build the binary)."""
    version = read_versions()["KUBERAY_VERSION"]
    out = subprocess.run(["go", "mod", "download", "-json", f"github.com/ray-project/kuberay/ray-operator@{version}"],
                         capture_output=True, text=True, check=True, cwd="/").stdout
    return Path(json.loads(out)["Dir"])


def kuberay_manifest(image: str, role_yaml: str) -> str:
    """KubeRay's operator as a Deployment: its own ClusterRole (config/rbac/role.yaml), bound to a ServiceAccount
    of ours; non-root, read-only root, no capabilities; no leader election (one replica); small requests."""
    labels = ", ".join(f"{k}: {v}" for k, v in KUBERAY_LABELS.items())
    return f"""{role_yaml.strip().removeprefix('---').strip()}
---
apiVersion: v1
kind: Namespace
metadata: {{name: {KUBERAY_NAMESPACE}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: kuberay-operator, namespace: {KUBERAY_NAMESPACE}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: kuberay-operator}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: kuberay-operator}}
subjects: [{{kind: ServiceAccount, name: kuberay-operator, namespace: {KUBERAY_NAMESPACE}}}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: kuberay-operator, namespace: {KUBERAY_NAMESPACE}, labels: {{{labels}}}}}
spec:
  replicas: 1
  strategy: {{type: Recreate}}
  selector: {{matchLabels: {{{labels}}}}}
  template:
    metadata: {{labels: {{{labels}}}}}
    spec:
      serviceAccountName: kuberay-operator
      securityContext:
        {{runAsNonRoot: true, runAsUser: 65532, runAsGroup: 65532, seccompProfile: {{type: RuntimeDefault}}}}
      containers:
      - name: kuberay-operator
        image: {image}
        imagePullPolicy: IfNotPresent
        args: ["--enable-leader-election=false", "--log-stdout-encoder=console", "--metrics-addr=:8080",
               "--health-probe-bind-address=:8082"]
        ports: [{{name: http, containerPort: 8080}}]
        readinessProbe: {{httpGet: {{path: /readyz, port: 8082}}, periodSeconds: 2}}
        livenessProbe: {{httpGet: {{path: /healthz, port: 8082}}, initialDelaySeconds: 10, periodSeconds: 10}}
        securityContext:
          {{allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {{drop: [ALL]}}}}
        resources: {{requests: {{cpu: 50m, memory: 128Mi}}, limits: {{memory: 512Mi}}}}
"""


def volume_manifest(host_dir: Path) -> str:
    """manifests/samples/volumes/toy-kuberay-pv.yaml with the hostPath pointed at `host_dir`."""
    text = VOLUME_SAMPLE.read_text()
    placeholder = "/var/lib/kora/toy-kuberay"
    assert placeholder in text, f"{VOLUME_SAMPLE} no longer names {placeholder}"
    return text.replace(placeholder, str(host_dir))


class E2ENode:
    """The steps of `make e2e-node` on a cluster recorded in `state_dir`."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir.resolve()
        self.cluster: LocalCluster | None = None
        self.volume = self.state_dir / "volume"
        self.timings: dict[str, float] = {}

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        out = fn()
        self.timings[name] = round(time.monotonic() - t0, 1)
        log(f"{name}: {self.timings[name]} s")
        return out

    @property
    def c(self) -> LocalCluster:
        assert self.cluster is not None, "the cluster is not up"
        return self.cluster

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 300) -> subprocess.CompletedProcess[str]:
        res: subprocess.CompletedProcess[str] = self.c.kubectl(*args, input=input, check=False, timeout=timeout)
        if check and res.returncode != 0:
            raise SystemExit(f"kubectl {' '.join(args)} failed ({res.returncode}):\n{res.stderr}{res.stdout}")
        return res

    # -- the steps
    def build_images(self) -> dict[str, dict[str, Any]]:
        """hack/images.py (both targets); the manifest of what it wrote, by target."""
        proc = subprocess.run([sys.executable, str(HERE / "images.py")], check=False)
        if proc.returncode != 0:
            raise SystemExit(f"hack/images.py failed (exit {proc.returncode})")
        return {m["target"]: m for m in json.loads((images.out_dir() / "images.json").read_text())}

    def up(self) -> None:
        self.cluster = LocalCluster.start(self.state_dir, stream=True, node=True)

    def import_images(self, built: dict[str, dict[str, Any]]) -> None:
        bins = provide_binaries()
        archive = self.state_dir / "images" / "kuberay-operator.tar"
        archive.parent.mkdir(parents=True, exist_ok=True)
        write_oci_archive(archive, kuberay_image_name(), {"ray-operator": ImageFile(bins / "ray-operator")},
                          ["/ray-operator"], user="65532:65532")
        for path in [archive, *(Path(m["archive"]) for m in built.values())]:
            names = localnode.import_image(self.state_dir, path)
            log(f"imported {path.name}: {', '.join(names)}")

    def install_kuberay(self) -> None:
        crds = sorted((provide_binaries() / "kuberay-crds").glob("*.yaml"))
        # server-side: the RayCluster/RayJob CRDs are too big for client-side apply's last-applied annotation
        self.kubectl("apply", "--server-side", *(a for p in crds for a in ("-f", str(p))))
        role = (kuberay_module_dir() / "config" / "rbac" / "role.yaml").read_text()
        self.kubectl("apply", "-f", "-", input=kuberay_manifest(kuberay_image_name(), role))
        self.kubectl("-n", KUBERAY_NAMESPACE, "rollout", "status", "deploy/kuberay-operator", "--timeout=180s")

    def install_kora(self, operator_image: str) -> None:
        repo, tag = operator_image.rsplit(":", 1)
        res = subprocess.run(
            [str(self.c.bin_dir / "helm"), "upgrade", "--install", "kora", str(ROOT / "charts" / "kora"),
             "--namespace", KORA_NAMESPACE, "--create-namespace", "--set", f"image.repository={repo}",
             "--set", f"image.tag={tag}", "--set", "image.pullPolicy=IfNotPresent", "--wait", "--timeout", "5m"],
            env=self.c.env(), text=True, capture_output=True, check=False)
        if res.returncode != 0:
            self.kubectl("-n", KORA_NAMESPACE, "describe", "pods", check=False)
            raise SystemExit(f"helm install kora failed:\n{res.stderr}{res.stdout}")
        log(res.stdout.strip().splitlines()[0] if res.stdout.strip() else "helm: installed")

    def make_volume(self) -> None:
        """The toy on the hostPath volume, writable for the Ray pods' user; the PV and claim."""
        toy = self.volume / "toy"
        if not (toy / "train.parquet").is_file():
            if not (TOY_CACHE / "train.parquet").is_file():  # made once (~1.5 min on 2 cores), as `make demo` does
                subprocess.run([str(Path(sys.executable).with_name("kora")), "make-toy", str(TOY_CACHE)], check=True,
                               stdout=subprocess.DEVNULL)
            shutil.copytree(TOY_CACHE, toy, dirs_exist_ok=True)
        shutil.rmtree(self.volume / "checkpoints", ignore_errors=True)  # a fresh run, not a resume of the last
        subprocess.run(["chown", "-R", f"{RAY_USER}:{RAY_USER}", str(self.volume)], check=True)
        self.kubectl("apply", "-f", "-", input=volume_manifest(self.volume))

    def apply_job(self, steps: int, interval: int) -> None:
        import yaml  # the venv's (make setup), like hack/e2e_kind.py

        doc = yaml.safe_load(SAMPLE.read_text())
        doc["spec"]["algorithm"]["numSteps"] = steps
        doc["spec"]["checkpoint"]["interval"] = interval
        self.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(doc, sort_keys=False))

    def status(self) -> dict[str, Any]:
        res = self.kubectl("get", "ltj", JOB, "-n", NAMESPACE, "-o", "json", check=False)
        return (json.loads(res.stdout).get("status") or {}) if res.returncode == 0 else {}

    def head_pod(self) -> str | None:
        out = self.kubectl("get", "pods", "-n", NAMESPACE, "-l", "ray.io/node-type=head", "-o", "json").stdout
        live = [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]
        return str(live[0]["metadata"]["name"]) if live else None

    def checkpoints(self) -> list[int]:
        root = self.volume / "checkpoints" / JOB
        return sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*") if p.name[5:].isdigit())

    def wait(self, timeout: float, until: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        """Print phase / step / reward as they change; return the status once final (or `until` holds)."""
        last, deadline = None, time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            prog = st.get("progress") or {}
            row = (st.get("phase"), prog.get("step"), prog.get("totalSteps"), prog.get("rewardMean"),
                   st.get("restarts"))
            if row != last:
                log(f"{JOB}: phase {row[0]} step {row[1]}/{row[2]} reward {row[3]} restarts {row[4]}")
                last = row
            if row[0] in FINAL or (until is not None and until(st)):
                return st
            time.sleep(1)
        self.dump()
        raise SystemExit(f"{JOB} did not get there within {timeout:.0f} s (last: {last})")

    def kill_head(self) -> tuple[str, int]:
        """Once a checkpoint is on the volume, delete the head pod at once; (its name, the newest checkpoint)."""
        wait_for(lambda: self.checkpoints() and self.head_pod(), timeout=900, interval=0.5,
                 what="a checkpoint on the volume while the head runs")
        pod, ckpt = self.head_pod(), self.checkpoints()[-1]
        assert pod is not None
        log(f"checkpoint step {ckpt} on the volume: kubectl delete pod {pod} --grace-period=0 --force")
        self.kubectl("delete", "pod", pod, "-n", NAMESPACE, "--grace-period=0", "--force", "--wait=false")
        return pod, ckpt

    def pods_wide(self) -> str:
        """`kubectl get pods -o wide -A`, and each pod's image (-o wide shows none)."""
        images = "custom-columns=NAMESPACE:.metadata.namespace,NAME:.metadata.name,IMAGE:.spec.containers[*].image"
        return self.kubectl("get", "pods", "-o", "wide", "-A").stdout + "\n" + \
            self.kubectl("get", "pods", "-A", "-o", images).stdout

    def dump(self) -> None:
        """What to look at when it went wrong."""
        for args in (("get", "rayjobs,rayclusters,pods,svc", "-A", "-o", "wide"),
                     ("describe", "ltj", JOB, "-n", NAMESPACE), ("describe", "pods", "-n", NAMESPACE),
                     ("logs", "-n", KORA_NAMESPACE, "deploy/kora", "--tail=60"),
                     ("logs", "-n", KUBERAY_NAMESPACE, "deploy/kuberay-operator", "--tail=40")):
            res = self.kubectl(*args, check=False)
            print(f"$ kubectl {' '.join(args)}\n{res.stdout}{res.stderr}", flush=True)

    def trainer_logs(self, pod: str | None = None) -> str:
        target = pod or self.head_pod()
        if target is None:
            return ""
        return self.kubectl("logs", "-n", NAMESPACE, target, "-c", "ray-head", check=False).stdout

    def down(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        elif (c := LocalCluster.load(self.state_dir)) is not None:
            c.stop()
        self.cluster = None


class PodTrace:
    """hack/nettrace.py over the head pod: strace attaches to every process of the pod's containers as soon as the
    first one runs (a thread polls /proc every 0.2 s for processes in the pod's cgroup) and follows their children,
    so `ray start`, GCS, raylet, the dashboard and the trainer's driver and actors are traced. What runs in the
    first ~0.2 s of the container (the shell that execs `ray start`) may be missed. Our bridge (10.213.0.0/16) and
    the Service network (10.0.0.0/24) count as local."""

    ALLOW = ("10.213.0.0/16", "10.0.0.0/24")

    def __init__(self, e: E2ENode, out: Path) -> None:
        self.e, self.out = e, out
        self.proc: subprocess.Popen[bytes] | None = None
        self.pod = ""
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._attach, daemon=True)
        self.thread.start()

    def _pids(self, uid: str) -> list[int]:
        mark = "pod" + uid
        found = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if mark in (d / "cgroup").read_text():
                        found.append(int(d.name))
                except OSError:
                    continue
        return sorted(found)

    @staticmethod
    def _cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            return b""

    def _attach(self) -> None:
        while not self.stop_event.is_set():
            out = self.e.kubectl("get", "pods", "-n", NAMESPACE, "-l", "ray.io/node-type=head", "-o", "json",
                                 check=False).stdout
            items = json.loads(out)["items"] if out else []
            pids = self._pids(items[0]["metadata"]["uid"]) if items else []
            # the container's own command (`bash -lc '...; ray start --head ...'`): not the pause process, nor a
            # `runc init` on its way to exec it (attached to, strace saw nothing once: the pid was gone)
            pids = [p for p in pids if b"ray start" in self._cmdline(p)]
            if pids:
                self.pod = items[0]["metadata"]["name"]
                argv = [nettrace.strace_path(), "-f", "-qq", "-Y", "-y", "-s", "256", "-e",
                        f"trace={nettrace.SYSCALLS}", "-o", str(self.out)]
                for pid in pids:
                    argv += ["-p", str(pid)]
                with self.out.with_suffix(".log").open("wb") as err:  # strace's own complaints (attach failures)
                    self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
                log(f"nettrace: strace attached to {self.pod} (pids {pids})")
                return
            time.sleep(0.2)

    def stop(self) -> nettrace.Trace | None:
        self.stop_event.set()
        self.thread.join(timeout=30)
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # strace detaches from the tracees and exits
            self.proc.wait(timeout=60)
        nets = [ipaddress.ip_network(a) for a in self.ALLOW]
        return nettrace.parse(self.out.read_text(errors="replace"), nets)


def submitter_logs(e: E2ENode) -> str:
    """The Ray job's driver output: KubeRay's submitter pod follows it (`ray job submit` tails the logs)."""
    return e.kubectl("logs", "-n", NAMESPACE, "-l", f"{COMPONENT_LABEL}=ray-submitter",
                     "--tail=-1", "--prefix", check=False).stdout


def run(args: argparse.Namespace) -> int:
    e = E2ENode(Path(args.dir))
    t0 = time.monotonic()
    try:
        built = e.timed("images", e.build_images)
        e.timed("cluster + node up", e.up)
        e.timed("image import", lambda: e.import_images(built))
        e.timed("KubeRay operator", e.install_kuberay)
        e.timed("helm install kora", lambda: e.install_kora(built["operator"]["image"]))
        e.timed("toy + volume", e.make_volume)
        trace = PodTrace(e, e.state_dir / "head-pod.strace") if args.nettrace else None
        e.apply_job(args.steps, args.interval)
        t_job = time.monotonic()
        e.wait(900, until=lambda st: st.get("phase") == "Running")
        pods = e.pods_wide()
        print(pods, flush=True)
        if args.pods_out:
            Path(args.pods_out).write_text(pods)
        if args.kill_head:
            e.kill_head()
        st = e.wait(args.timeout)
        e.timings["job"] = round(time.monotonic() - t_job, 1)
        if trace is not None:
            got = trace.stop()
            log(f"nettrace over {trace.pod}: " + (got.report() if got else "strace never attached"))
            if got is None or got.foreign or not got.counts:  # nothing traced is no evidence
                st = {**st, "phase": "Failed (nettrace)"}
        print(e.kubectl("get", "ltj", "-n", NAMESPACE).stdout, flush=True)
        print(e.kubectl("describe", "ltj", JOB, "-n", NAMESPACE).stdout, flush=True)
        progress = [ln for ln in submitter_logs(e).splitlines() if " step " in ln or "resumed from" in ln]
        print("\n".join(progress[-8:]), flush=True)
        if st.get("phase") != "Succeeded":
            e.dump()
            log(f"{JOB} {st.get('phase')}")
            return 1
        log(f"{JOB} Succeeded; {json.dumps(e.timings)}; total {time.monotonic() - t0:.0f} s")
        return 0
    finally:
        if args.keep:
            log(f"kept the cluster: export KUBECONFIG={e.state_dir / 'kubeconfig'}; "
                f"`python hack/localcluster.py down --dir {e.state_dir}` removes it")
        else:
            e.down()
            left = localnode.leftovers(e.state_dir)
            log("down: nothing left" if not left else f"down: LEFT {left}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(ROOT / ".kora" / "e2e-node"), help="the cluster's state dir")
    ap.add_argument("--steps", type=int, default=60, help="algorithm.numSteps of the toy job (default 60)")
    ap.add_argument("--interval", type=int, default=10, help="checkpoint.interval (default 10)")
    ap.add_argument("--kill-head", action="store_true", help="delete the head pod after the first checkpoint")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds to wait for the job once it runs")
    ap.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    ap.add_argument("--nettrace", action="store_true", help="trace the head pod's network calls (hack/nettrace.py); "
                    "fail on a destination off our bridge and Service network")
    ap.add_argument("--pods-out", help="write `kubectl get pods -o wide -A` (taken while the job runs) here")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("e2e-node: needs root (a bridge, iptables chains, mounts, cgroups; buildah)", file=sys.stderr)
        return 2
    if why := (localnode.missing_prerequisites() or ([images.problem()] if images.problem() else [])):
        print("e2e-node: cannot run here: " + "; ".join(why), file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
