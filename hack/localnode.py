#!/usr/bin/env python3
"""A real Kubernetes node for hack/localcluster.py's control plane: containerd, kubelet, kube-proxy,
kube-scheduler and CoreDNS, all under the cluster's own directory.

    python hack/localcluster.py up --node [--dir .kora]      # control plane + this node
    python hack/localcluster.py up --node --nodes 2          # ... + a second node in a netns of ours
    python hack/localcluster.py down [--dir .kora]           # stops and removes all of it
    python hack/localnode.py import-image ARCHIVE [--dir .kora]   # an OCI archive into the node
    python hack/localnode.py leftovers [--dir .kora]         # what of ours is still on the machine

Needs root and Debian's containerd, runc, containernetworking-plugins and iptables
(hack/install_tools.sh installs them); the pinned kubelet, kube-scheduler, kube-proxy and CoreDNS
come from `hack/testbin.sh --node`.

What it makes (everything under <dir>/node/ except what the kernel keeps globally):

* a bridge `kora0` holding 10.213.0.1/24 (pods get 10.213.0.0/24 from host-local); the apiserver
  binds to 10.213.0.1 instead of 127.0.0.1 so pods reach it through the `kubernetes` Service, and
  the node's InternalIP is that address too. A chain KORA-NODE in filter FORWARD drops whatever
  would cross between the bridge and any other interface: pod traffic stays on the bridge.
* containerd with its own config, root, state, socket, runc root and CNI config (bridge +
  host-local + portmap; loopback is containerd's own). The machine's limits cost three settings:
  `restrict_oom_score_adj` (no CAP_SYS_RESOURCE), cgroupfs, and netns mounts under our state dir.
* kubelet (cgroup v1, cgroupfs, root in cgroups /kora-node/..., root dir, pod logs, cert dir and
  volume plugin dir ours), kube-scheduler, kube-proxy in iptables mode (node ports only on the
  bridge; no sysctls changed), each authenticating with its own token.
* images no registry can give here, written as OCI archives (hack/ociimage.py) and imported with
  `ctr -n k8s.io image import`: kora.local/pause (a static C program, containerd's sandbox_image),
  kora.local/coredns (the pinned binary) and kora.local/nodeprobe (the tests' HTTP server/client).
* CoreDNS as a Deployment in kube-system behind the Service kube-dns (10.0.0.10), answering
  cluster.local only: it forwards nothing, so no name ever leaves the machine.
* with --nodes N, node i > 1 (`kora-node-i`): its own containerd, kubelet and kube-proxy under
  `nsenter --net` in a network namespace of ours, joined to the bridge by a veth (eth0 =
  10.213.0.(248+i)); its pods on 10.213.(i-1).0/24, which the machine routes to it over the bridge.

`down` (LocalCluster.stop -> teardown) stops kubelet, kube-proxy and the scheduler by pid, kills the
processes in our cgroups, lets containerd delete its tasks, stops containerd and any shim of ours,
then the control plane (its apiserver listens on the bridge address until it exits), unmounts what
is mounted under <dir>/node, removes our cgroups, iptables chains (KUBE-*, KORA-*, CNI-* ones of
our subnets, IPv4 and IPv6), the namespaces, the bridge and the pod log links, and restores
net.ipv4.ip_forward (the bridge plugin sets it). `leftovers()` lists anything still there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ociimage import ImageFile, write_oci_archive

if TYPE_CHECKING:
    from localcluster import LocalCluster

HACK_DIR = Path(__file__).resolve().parent
NODE_NAME = "kora-node"
BRIDGE = "kora0"
POD_SUBNET = "10.213.0.0/24"  # node 0's pods (node i's: 10.213.i.0/24)
PODS_SUPERNET = "10.213.0.0/16"
GATEWAY = "10.213.0.1"
CLUSTER_DNS = "10.0.0.10"  # inside localcluster.SERVICE_CIDR
CLUSTER_DOMAIN = "cluster.local"
CGROUP_ROOT = "kora-node"
CNI_NETWORK = "kora-node"
CNI_BIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
GUARD_CHAIN = "KORA-NODE"
SHIM_SOCKET_DIR = Path("/run/containerd/s")
PAUSE_IMAGE = "kora.local/pause:1"
PROBE_IMAGE = "kora.local/nodeprobe:1"
NETNS_DIR = Path("/run/netns")
MAX_NODES = 4
SHARED_USERS = {  # token user -> groups; each is bound by Kubernetes' bootstrap RBAC policy
    "kube-scheduler": ("system:kube-scheduler", ""),
    "kube-proxy": ("system:kube-proxy", ""),
}
READY_TIMEOUT = 180.0
NEEDED_COMMANDS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "ip6tables", "ip", "openssl")
NEEDED_CNI = ("bridge", "host-local", "portmap", "loopback")


class NodeError(RuntimeError):
    """The node could not be provided, started or cleaned up."""


@dataclass(frozen=True)
class NodeSpec:
    """Node `index` of the cluster. Node 0 runs in the machine's network namespace on the bridge's own
    address; node i > 0 runs in a network namespace of ours (`ip netns` name = the node's name), joined
    to the bridge by a veth pair, its pods on a bridge of the same name inside it."""

    index: int

    @property
    def suffix(self) -> str:
        return "" if self.index == 0 else f"-{self.index + 1}"

    @property
    def name(self) -> str:
        return NODE_NAME + self.suffix

    @property
    def netns(self) -> str | None:
        return None if self.index == 0 else self.name

    @property
    def node_ip(self) -> str:
        return GATEWAY if self.index == 0 else f"10.213.0.{249 + self.index}"

    @property
    def pod_subnet(self) -> str:
        return f"10.213.{self.index}.0/24"

    @property
    def pod_gateway(self) -> str:
        return f"10.213.{self.index}.1"

    @property
    def cgroup_root(self) -> str:
        return CGROUP_ROOT + self.suffix

    @property
    def host_veth(self) -> str:
        return f"{BRIDGE}n{self.index + 1}"

    def dir(self, state_dir: Path) -> Path:
        return node_dir(state_dir) if self.index == 0 else node_dir(state_dir) / self.name

    def proc(self, agent: str) -> str:
        return agent + self.suffix

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` run in the node's network namespace (nsenter: the mounts and /sys stay the machine's)."""
        return cmd if self.netns is None else ["nsenter", f"--net={NETNS_DIR / self.netns}", "--", *cmd]


def node_specs(record: dict[str, Any]) -> list[NodeSpec]:
    return [NodeSpec(i) for i in range(int(record.get("nodes", 1)))]


# --- preconditions --------------------------------------------------------------------------


def cni_bin_dir() -> str | None:
    for d in CNI_BIN_DIRS:
        if all(os.access(Path(d) / p, os.X_OK) for p in NEEDED_CNI):
            return d
    return None


def missing_prerequisites() -> list[str]:
    """Why a node cannot run here (empty when it can): root, commands, CNI plugins, cgroup v1."""
    why: list[str] = []
    if os.geteuid() != 0:
        why.append("not root (a node makes a bridge, iptables chains, mounts and cgroups)")
    why += [f"no `{c}` (hack/install_tools.sh installs it)" for c in NEEDED_COMMANDS if not shutil.which(c)]
    if cni_bin_dir() is None:
        plugins, dirs = ", ".join(NEEDED_CNI), " or ".join(CNI_BIN_DIRS)
        why.append(f"no CNI plugins {plugins} in {dirs} (containernetworking-plugins)")
    if not Path("/sys/fs/cgroup/memory").is_dir() and not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        why.append("no cgroup hierarchy under /sys/fs/cgroup")
    return why


def provide_node_binaries(stream: bool = False) -> Path:
    """`hack/testbin.sh --node` (honours $KORA_NODEBIN): the dir of kubelet, kube-scheduler, kube-proxy, coredns."""
    proc = subprocess.run(
        ["bash", str(HACK_DIR / "testbin.sh"), "--node"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=None if stream else subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise NodeError(f"hack/testbin.sh --node failed (exit {proc.returncode}): {(proc.stderr or '')[-3000:]}")
    return Path(lines[-1].strip())


# --- small helpers --------------------------------------------------------------------------


def run(cmd: Sequence[str], check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)
    if check and res.returncode != 0:
        raise NodeError(f"{' '.join(cmd)} exited {res.returncode}: {(res.stderr or res.stdout).strip()}")
    return res


def node_dir(state_dir: Path) -> Path:
    return state_dir / "node"


def containerd_socket(state_dir: Path, spec: NodeSpec | None = None) -> Path:
    return (spec or NodeSpec(0)).dir(state_dir) / "containerd" / "containerd.sock"


def ctr(
    state_dir: Path, *args: str, spec: NodeSpec | None = None, timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """`ctr` against node `spec`'s containerd, namespace k8s.io (the one the kubelet's CRI uses)."""
    return run(["ctr", "-a", str(containerd_socket(state_dir, spec)), "-n", "k8s.io", *args], timeout=timeout)


def import_image(state_dir: Path | str, archive: Path | str) -> list[str]:
    """Import an OCI (or docker-save) archive into every node's containerd; return the image names.

    The images are then usable by pods with `imagePullPolicy: Never` or `IfNotPresent`. For one node the
    same as `ctr -a <dir>/node/containerd/containerd.sock -n k8s.io image import ARCHIVE` (node i > 0:
    <dir>/node/kora-node-<i+1>/containerd/containerd.sock).
    """
    state_dir = Path(state_dir).resolve()
    specs = [NodeSpec(i) for i in range(MAX_NODES) if containerd_socket(state_dir, NodeSpec(i)).exists()]
    if not specs:
        raise NodeError(f"no node is up in {state_dir} (no {containerd_socket(state_dir)})")
    names: list[str] = []
    for spec in specs:
        out = ctr(state_dir, "image", "import", str(Path(archive).resolve()), spec=spec).stdout
        # ctr prints "unpacking <name> (sha256:...)...done" for each image
        names = re.findall(r"unpacking (\S+) \(", out)
    return names


def _mounts_under(root: Path) -> list[str]:
    """Mount points at or below `root`, deepest first (from /proc/self/mountinfo)."""
    prefix = str(root.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(set(points), key=lambda p: (-p.count("/"), p))


def _cgroup_dirs() -> list[Path]:
    """Our cgroup root in each mounted hierarchy that has it."""
    base = Path("/sys/fs/cgroup")
    if not base.is_dir():
        return []
    hierarchies = [base] + [d for d in base.iterdir() if d.is_dir() and not d.is_symlink()]
    roots = [NodeSpec(i).cgroup_root for i in range(MAX_NODES)]
    return [h / r for h in hierarchies for r in roots if (h / r).is_dir()]


def _cgroup_pids() -> set[int]:
    pids: set[int] = set()
    for root in _cgroup_dirs():
        for procs in root.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids |= {int(x) for x in procs.read_text().split()}
    return pids


def _our_shims(state_dir: Path) -> list[int]:
    """Pids of containerd shims started for our containerds (their command line names a socket of ours)."""
    socks = {str(containerd_socket(state_dir, NodeSpec(i))).encode() for i in range(MAX_NODES)}
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            argv
            and argv[0].decode(errors="replace").endswith(("containerd-shim-runc-v2", "containerd-shim"))
            and socks & set(argv)
        ):
            pids.append(int(d.name))
    return pids


def _iptables_chains(binary: str) -> dict[str, list[str]]:
    """table -> the chains of ours in it: KUBE-*, KORA-*, and CNI-* ones whose rules name our subnet."""
    ours: dict[str, list[str]] = {}
    res = run([f"{binary}-save"], check=False)
    table = ""
    chains: dict[str, list[str]] = {}
    rules: dict[str, list[str]] = {}
    for line in res.stdout.splitlines():
        if line.startswith("*"):
            table = line[1:]
            chains[table], rules[table] = [], []
        elif line.startswith(":"):
            chains[table].append(line[1:].split()[0])
        elif line.startswith("-A "):
            rules[table].append(line)
    for t, names in chains.items():
        mine = [c for c in names if c.startswith(("KUBE-", "KORA-"))]
        for c in names:
            if c.startswith("CNI-") and any(
                r.startswith(f"-A {c} ") and ("10.213." in r or CNI_NETWORK in r) for r in rules[t]
            ):
                mine.append(c)
        if mine:
            ours[t] = mine
    return ours


def _remove_iptables_chains(binary: str) -> None:
    for _ in range(3):  # jumps between chains of ours: a second pass gets what the first could not
        ours = _iptables_chains(binary)
        if not ours:
            return
        rules = run([f"{binary}-save"], check=False).stdout.splitlines()
        table = ""
        for line in rules:
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith("-A ") and table in ours:
                chain = line.split()[1]
                target = re.search(r" -[jg] (\S+)", line)
                if chain not in ours[table] and target and target.group(1) in ours[table]:
                    args = line[3:].split(" ", 1)  # "-A CHAIN rest" -> delete that exact rule
                    subprocess.run(
                        ["sh", "-c", f"{binary} -w -t {table} -D {args[0]} {args[1]}"],
                        capture_output=True,
                        check=False,
                    )
        for t, names in ours.items():
            for c in names:
                run([binary, "-w", "-t", t, "-F", c], check=False)
            for c in names:
                run([binary, "-w", "-t", t, "-X", c], check=False)


def _our_netns() -> list[str]:
    names = {NodeSpec(i).netns for i in range(1, MAX_NODES)}
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name in names) if NETNS_DIR.is_dir() else []


def _link_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


# --- the node -------------------------------------------------------------------------------


def prepare(state_dir: Path, nodes: int = 1) -> dict[str, Any]:
    """Before the control plane starts: our bridge (the apiserver binds to its address), the guard chain,
    the namespaces of nodes 2.., the tokens and certificates. Returns the node's record (kept in
    cluster.json under "node")."""
    if not 1 <= nodes <= MAX_NODES:
        raise NodeError(f"nodes must be 1..{MAX_NODES}, not {nodes}")
    if why := missing_prerequisites():
        raise NodeError("cannot run a node here: " + "; ".join(why))
    if _link_exists(BRIDGE):
        raise NodeError(
            f"a link named {BRIDGE} exists already: another node of ours is up (or was not taken down); "
            "`python hack/localcluster.py down --dir <its dir>` removes it"
        )
    nd = node_dir(state_dir)
    if nd.exists():  # a previous node's files, its mounts gone (leftovers() would name them)
        if _mounts_under(nd):
            raise NodeError(f"{nd} still has mounts ({_mounts_under(nd)[:3]}...): run `down` for it first")
        shutil.rmtree(nd)
    nd.mkdir(parents=True)
    record: dict[str, Any] = {
        "name": NODE_NAME,
        "dir": str(nd),
        "bridge": BRIDGE,
        "pod_subnet": POD_SUBNET,
        "node_ip": GATEWAY,
        "ip_forward_was": Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
        "var_log_containers_existed": Path("/var/log/containers").exists(),
        "run_netns_existed": NETNS_DIR.exists(),
        "nodes": nodes,
    }
    users = {f"kubelet{NodeSpec(i).suffix}": (f"system:node:{NodeSpec(i).name}", "system:nodes") for i in range(nodes)}
    record["users"] = {**users, **SHARED_USERS}
    record["tokens"] = {name: os.urandom(24).hex() for name in record["users"]}
    try:
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE])
        run(["ip", "link", "set", BRIDGE, "up"])
        run(["iptables", "-w", "-N", GUARD_CHAIN])
        run(["iptables", "-w", "-A", GUARD_CHAIN, "-i", BRIDGE, "!", "-o", BRIDGE, "-j", "DROP"])
        run(["iptables", "-w", "-A", GUARD_CHAIN, "!", "-i", BRIDGE, "-o", BRIDGE, "-j", "DROP"])
        run(["iptables", "-w", "-I", "FORWARD", "1", "-j", GUARD_CHAIN])
        for spec in node_specs(record)[1:]:
            _make_netns(spec)
        _make_pki(nd / "pki")
    except BaseException:
        _remove_network(record)
        shutil.rmtree(nd, ignore_errors=True)
        raise
    return record


def _make_netns(spec: NodeSpec) -> None:
    """Node `spec`'s namespace: eth0 = node_ip on our bridge (veth), default route via the bridge address;
    the machine routes the node's pod subnet to it (all of it over our bridge)."""
    assert spec.netns is not None
    ns = spec.netns
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", spec.host_veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
    run(["ip", "link", "set", spec.host_veth, "master", BRIDGE, "up"])
    run(["ip", "-n", ns, "addr", "add", f"{spec.node_ip}/24", "dev", "eth0"])
    run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    run(["ip", "-n", ns, "route", "add", "default", "via", GATEWAY])
    run(["ip", "route", "add", spec.pod_subnet, "via", spec.node_ip, "dev", BRIDGE])


def token_lines(record: dict[str, Any]) -> str:
    """Lines for the apiserver's token file: one user per node component."""
    out = ""
    for name, (user, groups) in record["users"].items():
        out += f"{record['tokens'][name]},{user},uid-{name}" + (f',"{groups}"' if groups else "") + "\n"
    return out


def apiserver_flags(record: dict[str, Any]) -> list[str]:
    pki = Path(record["dir"]) / "pki"
    return [
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        "--kubelet-preferred-address-types=InternalIP",
    ]


def _make_pki(pki: Path) -> None:
    """A CA the kubelet trusts for client certificates, and the apiserver's client certificate under it."""
    pki.mkdir(parents=True)
    days = "3650"
    run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "ca.key"),
         "-out", str(pki / "ca.crt"), "-subj", "/CN=kora-node-ca", "-days", days])  # fmt: skip
    run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "apiserver-kubelet-client.key"),
         "-out", str(pki / "client.csr"), "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client"])  # fmt: skip
    run(["openssl", "x509", "-req", "-in", str(pki / "client.csr"), "-CA", str(pki / "ca.crt"),
         "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-out", str(pki / "apiserver-kubelet-client.crt"),
         "-days", days])  # fmt: skip
    for key in pki.glob("*.key"):
        key.chmod(0o600)


def build_images(nd: Path, node_bins: Path) -> dict[str, Path]:
    """The pause, CoreDNS and probe images as OCI archives under <node>/images; name -> archive."""
    from localcluster import read_versions

    images = nd / "images"
    images.mkdir(parents=True, exist_ok=True)
    pause = images / "pause"
    run(["gcc", "-static", "-Os", "-s", "-o", str(pause), str(HACK_DIR / "node" / "pause.c")])
    probe = images / "nodeprobe"
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-buildvcs=false"}
    res = subprocess.run(
        ["go", "build", "-ldflags", "-s -w", "-o", str(probe), "."],
        cwd=HACK_DIR / "node" / "probe", env=env, capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    if res.returncode != 0:
        raise NodeError(f"go build nodeprobe failed: {res.stderr}")
    coredns_image = f"kora.local/coredns:{read_versions()['COREDNS_VERSION']}"
    out = {
        PAUSE_IMAGE: images / "pause.tar",
        coredns_image: images / "coredns.tar",
        PROBE_IMAGE: images / "nodeprobe.tar",
    }
    write_oci_archive(out[PAUSE_IMAGE], PAUSE_IMAGE, {"pause": ImageFile(pause)}, ["/pause"])
    write_oci_archive(out[coredns_image], coredns_image, {"coredns": ImageFile(node_bins / "coredns")}, ["/coredns"])
    write_oci_archive(out[PROBE_IMAGE], PROBE_IMAGE, {"nodeprobe": ImageFile(probe)}, ["/nodeprobe"])
    return out


def _write_configs(
    cluster: LocalCluster, record: dict[str, Any], spec: NodeSpec, ports: dict[str, int]
) -> dict[str, Path]:
    """Node `spec`'s config files (containerd, CNI, kubelet, kube-proxy, kubeconfigs) under its dir."""
    from localcluster import _write_kubeconfig

    top = Path(record["dir"])
    nd = spec.dir(cluster.state_dir)
    ca_file = Path(cluster.run_dir) / "apiserver-certs" / "apiserver.crt"
    paths: dict[str, Path] = {}
    kubelet_user = f"kubelet{spec.suffix}"
    for name in (kubelet_user, *SHARED_USERS):
        user = record["users"][name][0]
        paths[f"{name.removesuffix(spec.suffix)}.kubeconfig"] = nd / f"{name}.kubeconfig"
        _write_kubeconfig(nd / f"{name}.kubeconfig", cluster.server, ca_file, user, record["tokens"][name])

    # containerd
    cd = nd / "containerd"
    cni_conf = nd / "cni" / "net.d"
    cni_conf.mkdir(parents=True, exist_ok=True)
    (nd / "cni" / "ipam").mkdir(parents=True, exist_ok=True)
    paths["containerd.toml"] = cd / "config.toml"
    cd.mkdir(parents=True, exist_ok=True)
    paths["containerd.toml"].write_text(
        f"""version = 2
root = "{cd / "root"}"
state = "{cd / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{containerd_socket(cluster.state_dir, spec)}"

[ttrpc]
  address = ""

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{cd / "opt"}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # no CAP_SYS_RESOURCE here: without this the pause container dies with
  # "can't get final child's PID from pipe: EOF"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_unprivileged_ports = false

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{cd / "runc"}"

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin_dir()}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
"""
    )
    (cni_conf / "10-kora-node.conflist").write_text(
        json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": CNI_NETWORK,
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": BRIDGE,
                        "isGateway": True,
                        "ipMasq": False,  # nothing leaves the bridge (the KORA-NODE chain drops it anyway)
                        "hairpinMode": True,
                        "ipam": {
                            "type": "host-local",
                            "ranges": [
                                [
                                    {
                                        "subnet": spec.pod_subnet,
                                        "gateway": spec.pod_gateway,
                                        "rangeEnd": _last_pod_ip(spec),
                                    }
                                ]
                            ],
                            "routes": [{"dst": "0.0.0.0/0"}],
                            "dataDir": str(nd / "cni" / "ipam"),
                        },
                    },
                    {"type": "portmap", "capabilities": {"portMappings": True}},
                ],
            },
            indent=2,
        )
    )

    # kubelet
    kd = nd / "kubelet"
    kd.mkdir(parents=True, exist_ok=True)
    (nd / "resolv.conf").write_text("# pods get only the cluster DNS (kubelet clusterDNS); no host search domains\n")
    paths["kubelet.yaml"] = nd / "kubelet.yaml"
    paths["kubelet.yaml"].write_text(
        f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {spec.node_ip}
port: {ports["kubelet"]}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {ports["kubelet_healthz"]}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {top / "pki" / "ca.crt"}}}
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix://{containerd_socket(cluster.state_dir, spec)}
# the machine: cgroup v1 only, no systemd, swap allowed
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /{spec.cgroup_root}
failSwapOn: false
clusterDNS: [{CLUSTER_DNS}]
clusterDomain: {CLUSTER_DOMAIN}
resolvConf: {nd / "resolv.conf"}
podLogsDir: {nd / "pod-logs"}
volumePluginDir: {kd / "volume-plugins"}
registerNode: true
rotateCertificates: false
serverTLSBootstrap: false
# nothing can be pulled: never collect images; a small disk is not pressure here
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}}
maxPods: 60
"""
    )

    # kube-proxy
    paths["kube-proxy.yaml"] = nd / "kube-proxy.yaml"
    paths["kube-proxy.yaml"].write_text(
        f"""apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {paths["kube-proxy.kubeconfig"]}
mode: iptables
hostnameOverride: {spec.name}
bindAddress: {spec.node_ip}
clusterCIDR: {PODS_SUPERNET}
healthzBindAddress: {spec.node_ip}:{ports["proxy_healthz"]}
metricsBindAddress: 127.0.0.1:{ports["proxy_metrics"]}
nodePortAddresses: [{spec.pod_subnet}]
iptables:
  localhostNodePorts: false   # else it sets net.ipv4.conf.all.route_localnet
# leave the machine's conntrack sysctls as they are
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"""
    )
    return paths


def _last_pod_ip(spec: NodeSpec) -> str:
    """Node 0's pods share the bridge's /24 with the other nodes' addresses (.250 up): they stop below."""
    return f"10.213.{spec.index}.{239 if spec.index == 0 else 254}"


def _make_cgroup_root(spec: NodeSpec) -> None:
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():  # unified only
        (base / spec.cgroup_root).mkdir(exist_ok=True)
        return
    for h in base.iterdir():
        if not h.is_dir() or h.is_symlink() or h.name == "unified":
            continue
        d = h / spec.cgroup_root
        d.mkdir(exist_ok=True)
        if h.name == "cpuset" or (h / "cpuset.cpus").exists():
            for f in ("cpuset.cpus", "cpuset.mems"):
                (d / f).write_text((h / f).read_text())


def start(cluster: LocalCluster, record: dict[str, Any], node_bins: Path) -> None:
    """After the control plane is up: per node containerd (images imported), kubelet and kube-proxy; one
    kube-scheduler; every node Ready; then CoreDNS."""
    from localcluster import free_ports, http_get

    state_dir = cluster.state_dir
    nd = Path(record["dir"])
    specs = node_specs(record)
    cluster.state["node"] = record
    timings: dict[str, float] = record.setdefault("seconds", {})
    t = time.monotonic()
    images = build_images(nd, node_bins)
    timings["images built"] = round(time.monotonic() - t, 2)
    t = time.monotonic()
    (scheduler_port,) = free_ports(1)
    configs: dict[int, dict[str, Path]] = {}
    for spec in specs:
        names = ("kubelet", "kubelet_healthz", "proxy_healthz", "proxy_metrics")
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        record.setdefault("ports", {})[spec.name] = ports
        paths = configs[spec.index] = _write_configs(cluster, record, spec, ports)
        _make_cgroup_root(spec)
        sock = str(containerd_socket(state_dir, spec))
        cluster._spawn(spec.proc("containerd"), spec.wrap(["containerd", "--config", str(paths["containerd.toml"])]))
        cluster._await(
            spec.proc("containerd"),
            lambda sock=sock: run(["ctr", "-a", sock, "version"], check=False).returncode == 0,
            what=f"{spec.proc('containerd')} to answer on its socket",
        )
    for archive in images.values():
        import_image(state_dir, archive)
    timings["containerd and images"] = round(time.monotonic() - t, 2)
    t = time.monotonic()
    cluster._spawn("kube-scheduler", [
        str(node_bins / "kube-scheduler"),
        f"--kubeconfig={configs[0]['kube-scheduler.kubeconfig']}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1", f"--secure-port={scheduler_port}",
        f"--cert-dir={nd / 'scheduler-certs'}",
        "--profiling=false",
    ])  # fmt: skip
    for spec in specs:
        paths, sd = configs[spec.index], spec.dir(state_dir)
        cluster._spawn(spec.proc("kubelet"), spec.wrap([
            str(node_bins / "kubelet"),
            f"--config={paths['kubelet.yaml']}",
            f"--kubeconfig={paths['kubelet.kubeconfig']}",
            f"--root-dir={sd / 'kubelet'}",
            f"--cert-dir={sd / 'kubelet' / 'pki'}",
            f"--node-ip={spec.node_ip}",
            f"--hostname-override={spec.name}",
        ]))  # fmt: skip
        cluster._spawn(
            spec.proc("kube-proxy"), spec.wrap([str(node_bins / "kube-proxy"), f"--config={paths['kube-proxy.yaml']}"])
        )
    cluster._await("kube-scheduler", lambda: http_get(f"https://127.0.0.1:{scheduler_port}/healthz")[0] == 200)
    for spec in specs:
        cluster._await(
            spec.proc("kubelet"),
            lambda spec=spec: node_ready(cluster, spec.name),
            what=f"node {spec.name} to be Ready",
            timeout=READY_TIMEOUT,
        )
        port = record["ports"][spec.name]["proxy_healthz"]
        cluster._await(
            spec.proc("kube-proxy"),
            lambda spec=spec, port=port: http_get(f"http://{spec.node_ip}:{port}/healthz")[0] == 200,
        )
    timings["nodes ready"] = round(time.monotonic() - t, 2)
    t = time.monotonic()
    deploy_coredns(cluster)
    cluster._await(
        "kubelet",
        lambda: _available(cluster, "kube-system", "coredns"),
        what="CoreDNS to be available",
        timeout=READY_TIMEOUT,
    )
    timings["coredns"] = round(time.monotonic() - t, 2)
    cluster._save()


def _available(cluster: LocalCluster, ns: str, deploy: str) -> bool:
    res = cluster.kubectl("-n", ns, "get", "deploy", deploy, "-o", "jsonpath={.status.availableReplicas}", check=False)
    return res.stdout.strip() == "1"


def node_ready(cluster: LocalCluster, name: str = NODE_NAME) -> bool:
    res = cluster.kubectl(
        "get", "node", name, "-o", 'jsonpath={.status.conditions[?(@.type=="Ready")].status}', check=False
    )
    return bool(res.stdout.strip() == "True")


def coredns_manifest(image: str) -> str:
    corefile = f""".:53 {{
    errors
    health :8080
    ready :8181
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }}
    cache 30
    loadbalance
}}
"""
    indented = "".join(f"    {ln}\n" for ln in corefile.splitlines())
    return f"""apiVersion: v1
kind: ServiceAccount
metadata: {{name: coredns, namespace: kube-system}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: "system:coredns"}}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: "system:coredns"}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}}
subjects: [{{kind: ServiceAccount, name: coredns, namespace: kube-system}}]
---
apiVersion: v1
kind: ConfigMap
metadata: {{name: coredns, namespace: kube-system}}
data:
  # cluster.local only, no `forward`: a name outside the cluster is refused, never sent off the machine
  Corefile: |
{indented}---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: coredns, namespace: kube-system, labels: {{k8s-app: kube-dns}}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{k8s-app: kube-dns}}}}
  template:
    metadata: {{labels: {{k8s-app: kube-dns}}}}
    spec:
      serviceAccountName: coredns
      dnsPolicy: Default
      containers:
      - name: coredns
        image: {image}
        imagePullPolicy: Never
        args: ["-conf", "/etc/coredns/Corefile"]
        ports:
        - {{name: dns, containerPort: 53, protocol: UDP}}
        - {{name: dns-tcp, containerPort: 53, protocol: TCP}}
        resources: {{requests: {{cpu: 50m, memory: 40Mi}}, limits: {{memory: 170Mi}}}}
        securityContext:
          allowPrivilegeEscalation: false
          capabilities: {{drop: [ALL], add: [NET_BIND_SERVICE]}}
          readOnlyRootFilesystem: true
        livenessProbe: {{httpGet: {{path: /health, port: 8080}}, periodSeconds: 10}}
        readinessProbe: {{httpGet: {{path: /ready, port: 8181}}, periodSeconds: 2}}
        volumeMounts: [{{name: config, mountPath: /etc/coredns, readOnly: true}}]
      volumes: [{{name: config, configMap: {{name: coredns}}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: kube-dns, namespace: kube-system, labels: {{k8s-app: kube-dns}}}}
spec:
  clusterIP: {CLUSTER_DNS}
  selector: {{k8s-app: kube-dns}}
  ports:
  - {{name: dns, port: 53, protocol: UDP}}
  - {{name: dns-tcp, port: 53, protocol: TCP}}
"""


def deploy_coredns(cluster: LocalCluster) -> None:
    from localcluster import read_versions

    image = f"kora.local/coredns:{read_versions()['COREDNS_VERSION']}"
    cluster.kubectl("apply", "-f", "-", input=coredns_manifest(image))


# --- teardown -------------------------------------------------------------------------------


def teardown(cluster: LocalCluster, between: Callable[[], None] | None = None) -> None:
    """Stop the node's processes and remove all it made. Idempotent; safe on a half-started node.

    `between` runs after the node's processes stop and before the network goes: LocalCluster.stop stops
    the control plane there, whose apiserver listens on the bridge's address until it has exited."""
    record = cluster.state.get("node") or {}
    nd = Path(record.get("dir") or node_dir(cluster.state_dir))
    took: dict[str, float] = cluster.state.setdefault("teardown_seconds", {})
    _stop_processes(cluster, took)
    if between is not None:
        t = time.monotonic()
        between()
        took["control plane"] = round(time.monotonic() - t, 2)
    t = time.monotonic()
    # mounts (rootfs overlays, shm, netns bind mounts, the kubelet's volume tmpfs), deepest first
    for point in _mounts_under(nd) if nd.exists() else []:
        if run(["umount", point], check=False).returncode != 0:
            run(["umount", "-l", point], check=False)
    _remove_cgroups()
    took["mounts and cgroups"] = round(time.monotonic() - t, 2)
    t = time.monotonic()
    _remove_network(record)
    took["iptables and bridge"] = round(time.monotonic() - t, 2)
    _remove_log_links(nd, record)
    # containerd 1.6 puts its shims' sockets in /run/containerd/s whatever its state dir; each shim
    # removes its own: the dirs go if empty (a containerd of the machine's own would keep them full)
    for d in (SHIM_SOCKET_DIR, SHIM_SOCKET_DIR.parent):
        with contextlib.suppress(OSError):
            d.rmdir()
    if nd.exists() and not _mounts_under(nd):
        shutil.rmtree(nd, ignore_errors=True)


def _stop_processes(cluster: LocalCluster, took: dict[str, float]) -> None:
    from localcluster import stop_procs, wait_for

    procs, state_dir = cluster.procs, cluster.state_dir
    t = time.monotonic()
    # the agents first, so nothing restarts what we stop
    agents = [n for n in procs if n.startswith(("kube-proxy", "kubelet"))] + ["kube-scheduler"]
    stop_procs([procs[n] for n in agents if n in procs])
    took["agents"] = round(time.monotonic() - t, 2)
    t = time.monotonic()
    # the pods' processes (all in our cgroups); containerd, still up, then deletes their tasks
    for _ in range(3):
        pids = _cgroup_pids()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not _cgroup_pids(), timeout=10, what="the pods' processes to exit")
    containerds = [n for n in procs if n.startswith("containerd")]
    if any(procs[n].alive() for n in containerds):
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not _our_shims(state_dir), timeout=15, what="containerd to delete its tasks")
    took["pods"] = round(time.monotonic() - t, 2)
    t = time.monotonic()
    # containerd, then any shim of ours it left behind
    stop_procs([procs[n] for n in containerds])
    for pid in _our_shims(state_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not _our_shims(state_dir), timeout=10, what="our shims to exit")
    took["containerd"] = round(time.monotonic() - t, 2)
    for n in [*agents, *containerds]:
        procs.pop(n, None)


def _remove_cgroups() -> None:
    for root in _cgroup_dirs():
        for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            root.rmdir()


def _remove_network(record: dict[str, Any]) -> None:
    """iptables chains (kube-proxy's and the kubelet's KUBE-*, our KORA-NODE, CNI ones of our subnet), the
    bridge (and any veth left on it), and the sysctl the bridge plugin set."""
    for binary in ("iptables", "ip6tables"):
        if shutil.which(binary):
            _remove_iptables_chains(binary)
    for ns in _our_netns():  # its veth (and the route through it) go with it
        run(["ip", "netns", "del", ns], check=False)
    # `ip netns add` made /run/netns (a bind mount of itself); if it was ours and is empty now, it goes
    if record.get("run_netns_existed") is False and NETNS_DIR.is_dir() and not any(NETNS_DIR.iterdir()):
        run(["umount", str(NETNS_DIR)], check=False)
        with contextlib.suppress(OSError):
            NETNS_DIR.rmdir()
    if _link_exists(BRIDGE):
        run(["ip", "link", "del", BRIDGE], check=False)
    was = record.get("ip_forward_was")
    if was in ("0", "1"):
        Path("/proc/sys/net/ipv4/ip_forward").write_text(was)


def _remove_log_links(nd: Path, record: dict[str, Any]) -> None:
    """The kubelet's links in /var/log/containers to our pod logs (and the dir, if it made it)."""
    logs = Path("/var/log/containers")
    if not logs.is_dir():
        return
    for link in logs.iterdir():
        with contextlib.suppress(OSError):
            if link.is_symlink() and os.readlink(link).startswith(str(nd)):
                link.unlink()
    if record and not record.get("var_log_containers_existed", True):
        with contextlib.suppress(OSError):
            logs.rmdir()


def leftovers(state_dir: Path | str) -> list[str]:
    """Everything of a node of ours still on the machine; empty after a clean `down`."""
    state_dir = Path(state_dir).resolve()
    nd = node_dir(state_dir)
    found: list[str] = []
    if nd.exists():
        found += [f"mount {m}" for m in _mounts_under(nd)]
        found.append(f"dir {nd}")
    found += [f"shim pid {p}" for p in _our_shims(state_dir)]
    found += [f"process in our cgroups: {p}" for p in sorted(_cgroup_pids())]
    found += [f"cgroup {d}" for d in _cgroup_dirs()]
    if _link_exists(BRIDGE):
        found.append(f"link {BRIDGE}")
    found += [f"netns {ns}" for ns in _our_netns()]
    routes = run(["ip", "route", "show"], check=False).stdout.splitlines()
    found += [f"route {r}" for r in routes if r.startswith("10.213.")]
    for binary in ("iptables", "ip6tables"):
        if shutil.which(binary):
            for table, chains in _iptables_chains(binary).items():
                found += [f"{binary} -t {table} chain {c}" for c in chains]
    veths = [p.name for p in Path("/sys/class/net").iterdir() if (p / "master").exists() and
             Path(os.path.realpath(p / "master")).name == BRIDGE]  # fmt: skip
    found += [f"link {v} on {BRIDGE}" for v in veths]
    if SHIM_SOCKET_DIR.is_dir() and not any(SHIM_SOCKET_DIR.iterdir()):
        found.append(f"empty dir {SHIM_SOCKET_DIR}")
    logs = Path("/var/log/containers")
    if logs.is_dir():
        found += [f"link {p}" for p in logs.iterdir() if p.is_symlink() and os.readlink(p).startswith(str(nd))]
    return found


# --- CLI ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="localnode.py", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", default=".kora", help="the cluster's state dir (default: .kora)")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser(
        "import-image", parents=[common], help="import an OCI archive into the node's containerd (namespace k8s.io)"
    )
    imp.add_argument("archive")
    sub.add_parser(
        "leftovers", parents=[common], help="list what of a node of ours is still on the machine (exit 1 if any)"
    )
    args = parser.parse_args(argv)
    state_dir = Path(args.dir).resolve()
    if args.command == "import-image":
        try:
            names = import_image(state_dir, args.archive)
        except NodeError as exc:
            print(f"localnode: {exc}", file=sys.stderr)
            return 1
        print("\n".join(names) or "(imported; ctr named no image)")
        return 0
    left = leftovers(state_dir)
    print("\n".join(left) or "nothing left")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
