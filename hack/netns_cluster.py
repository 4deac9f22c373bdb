#!/usr/bin/env python3
"""A two-node Ray cluster on one machine, each node in a network namespace of its own (needs root and `ip`).

Ray 2.60 keeps a single node on 127.0.0.1 (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) and otherwise advertises the
machine's own network address, which tests here must never use. So: two namespaces `kora-<pid>-a` and
`kora-<pid>-b` joined by a veth pair, `10.X.Y.1` and `10.X.Y.2` from a private /24 that no route, address or
resolver of the machine uses, and no other route at all: nothing in them can reach past the pair. A Ray head
runs in A (`ray start --head --block --node-ip-address=10.X.Y.1`), a second node in B joins it as soon as the
head's GCS listens; `start` returns once Ray, asked from inside A, reports both alive. Each node has its
own CPUs, resources, temp dir and HOME (holding the bootstrap config that stops Ray's cloud-metadata probe,
kora_trainer/config/ray_env.py), and both share one token for Ray's token authentication.

A driver runs inside A (`cluster.run_in(cluster.head.netns, argv)`, `popen_in`, `run_traced_in`) with
`cluster.env()`: RAY_ADDRESS and the token. Anything bound to a node's address is reachable from the other node;
127.0.0.1 is each namespace's own, and the machine's own network is out of reach from both.

Stopped by pid: SIGTERM to each `ray start --block` (it drains and stops its node), then SIGKILL to whatever
is still in the namespaces (`ip netns pids`); then the namespaces (and the veth pair with them) and the temp
dirs go. `leftovers()` says what of it is still there (nothing, after `stop`).

    python hack/netns_cluster.py up      # prints the Ray address and the env a driver needs; state in .kora/netns/
    python hack/netns_cluster.py down
    python hack/netns_cluster.py smoke   # a cluster of its own, one task on each node from a driver in A, then down
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kora_trainer.config.ray_env import multi_node_env, ray_home
from localcluster import pid_alive, proc_start_time, wait_for
from nettrace import SYSCALLS, Trace, parse, strace_path

STATE_DIR = Path(__file__).resolve().parents[1] / ".kora" / "netns"
GCS_PORT = 6379  # each namespace has its own ports: Ray's defaults cannot clash with anything outside
RAY = str(Path(sys.executable).with_name("ray"))
# the connects Ray makes to learn a node's address (`node_ip_address_from_perspective`): refused in a namespace
# with no default route, so they send nothing; any other refused destination is a finding
RAY_ADDRESS_PROBES = frozenset({"8.8.8.8:53", "2001:4860:4860::8888:53"})


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def netns_list() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    """The processes in a namespace (nothing when it does not exist)."""
    out = ip("netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and pid_alive(int(p))]


def netns_inode(netns: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{netns}").st_ino
    except OSError:
        return None


def pids_in_inodes(inodes: Sequence[int]) -> list[int]:
    """Living processes whose network namespace is one of `inodes`: found even after the name is gone."""
    wanted = {f"net:[{i}]" for i in inodes}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ns = os.readlink(entry / "ns" / "net")
        except OSError:
            continue
        if ns in wanted and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the machine routes or holds an address in, in any namespace, and its resolvers."""
    nets: list[ipaddress.IPv4Network] = []
    for args in (["-4", "route", "show", "table", "all"], ["-4", "-o", "addr"]):
        for word in ip(*args, check=False).stdout.split():
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.IPv4Network(word, strict=False))
    for ns in netns_list():
        for word in ip("-n", ns, "-4", "-o", "addr", check=False).stdout.split():
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.IPv4Network(word, strict=False))
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            if line.startswith("nameserver"):
                with contextlib.suppress(ValueError, IndexError):
                    nets.append(ipaddress.IPv4Network(line.split()[1]))
    return [n for n in nets if n.prefixlen > 0]  # "default" parses as no network; 0.0.0.0/0 would clash with all


def pick_subnet(seed: int) -> ipaddress.IPv4Network:
    """A 10.X.Y.0/24 that overlaps nothing `used_networks` lists, starting from one `seed` picks."""
    used = used_networks()
    for i in range(150 * 256):
        n = (seed + i) % (150 * 256)
        net = ipaddress.IPv4Network(f"10.{100 + n // 256}.{n % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 left")


@dataclass
class Node:
    """One Ray node: its namespace, its end of the veth pair, its address and its own directories."""

    role: str  # "head" or "worker"
    netns: str
    veth: str
    address: str
    temp_dir: str  # Ray's --temp-dir (session dirs, logs, sockets)
    home: str  # HOME of its Ray processes: holds the bootstrap config
    log: str  # what `ray start` printed
    num_cpus: float
    resources: dict[str, float]
    object_store_mb: int
    trace_file: str | None = None  # strace output when the node is traced
    pid: int | None = None  # the `ray start --block` process, or strace around it
    start_time: str | None = None

    def ray_start_pids(self) -> list[int]:
        """The `ray start` process: `pid`, or, traced, strace's child."""
        if self.pid is None or not pid_alive(self.pid, self.start_time):
            return []
        if self.trace_file is None:
            return [self.pid]
        return [p for p in netns_pids(self.netns) if _ppid(p) == self.pid]


@dataclass
class NetTrace:
    """What a traced process tree reached: nettrace's verdict on everything that was sent (loopback, the
    namespaces' subnet, or foreign), and apart, the connects the kernel refused with ENETUNREACH, which sent
    nothing (a namespace has no route past its /24)."""

    sent: Trace
    unreachable: list[tuple[int, str, str]] = field(default_factory=list)  # (pid, process, "addr:port")

    def unexpected_unreachable(self) -> list[tuple[int, str, str]]:
        return [u for u in self.unreachable if u[2].split(" (DNS", 1)[0] not in RAY_ADDRESS_PROBES]

    def report(self) -> str:
        lines = [self.sent.report(), f"refused as unreachable (nothing sent): {len(self.unreachable)}"]
        lines += [f"  UNREACHABLE {dest} from pid {pid} ({proc})" for pid, proc, dest in self.unreachable]
        return "\n".join(lines)


_UNFINISHED = re.compile(r"^(\d+)(<[^>]*>)?\s+(.*) <unfinished \.\.\.>$")
_RESUMED = re.compile(r"^(\d+)(<[^>]*>)?\s+<\.\.\. \w+ resumed>(.*)$")
_CONNECT = re.compile(r"^\d+(<[^>]*>)?\s+connect\(")


def merge_resumed(text: str) -> list[str]:
    """strace -f lines with each `<unfinished ...>` call joined to its `<... resumed>` end, so a call's
    arguments and its result are on one line."""
    pending: dict[str, str] = {}
    lines = []
    for raw in text.splitlines():
        if m := _UNFINISHED.match(raw):
            pending[m.group(1)] = raw.removesuffix(" <unfinished ...>")
        elif (m := _RESUMED.match(raw)) and m.group(1) in pending:
            lines.append(pending.pop(m.group(1)) + m.group(3))
        else:
            lines.append(raw)
    return lines + list(pending.values())


def judge_trace(text: str, allow: Sequence[str]) -> NetTrace:
    """Split a raw strace text: connects refused with ENETUNREACH, and the rest for nettrace.parse."""
    lines = merge_resumed(text)
    refused = [bool(_CONNECT.match(ln)) and "= -1 ENETUNREACH" in ln for ln in lines]
    nets = [ipaddress.ip_network(a, strict=False) for a in allow]
    sent = parse("\n".join(ln for ln, r in zip(lines, refused, strict=True) if not r), nets)
    # each refused connect on its own, after the exec/clone lines that name its process (nettrace.parse counts
    # one DNS socket per pid and fd, and Ray's probes to 8.8.8.8 and its IPv6 twin share one)
    naming = "\n".join(ln for ln in lines if not any(c in ln for c in ("connect(", "sendto(", "sendmsg(", "sendmmsg(")))
    unreachable = [f for ln, r in zip(lines, refused, strict=True) if r for f in parse(f"{naming}\n{ln}", []).foreign]
    return NetTrace(sent, unreachable)


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


@dataclass
class NetnsCluster:
    """Two Ray nodes in two namespaces. `start()` builds it, `stop()` takes every piece of it away."""

    tag: str
    root: str  # a private dir holding every node's temp dir, HOME, log and trace
    subnet: str
    port: int
    token: str
    head: Node
    worker: Node
    inodes: list[int] = field(default_factory=list)  # the namespaces' inodes, to find processes left in them
    made: list[str] = field(default_factory=list)  # the namespaces made so far (the veth pair lives in them)
    traces: dict[str, NetTrace] = field(default_factory=dict)  # by node role, after stop() of a traced cluster
    alive: list[dict[str, object]] = field(default_factory=list)  # the nodes Ray reported alive when started
    ended: list[int] = field(default_factory=list)  # the pids stop() found in the namespaces and ended
    _popens: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def create(cls, cpus_per_node: float = 1, resources: Sequence[Mapping[str, float]] = ({}, {}),
               trace: bool = False, object_store_mb: int = 300, tag: str | None = None) -> NetnsCluster:
        """The plan: names, addresses, dirs. Nothing is made until `start`."""
        tag = tag or str(os.getpid())
        net = pick_subnet(os.getpid() + secrets.randbelow(256))
        hosts = list(net.hosts())
        root = tempfile.mkdtemp(prefix=f"kora-netns-{tag}-", dir="/tmp")  # short: Ray's socket paths < 107 bytes
        nodes = []
        for i, (role, letter) in enumerate((("head", "a"), ("worker", "b"))):
            d = Path(root) / letter
            nodes.append(Node(role, f"kora-{tag}-{letter}", f"k{tag[:13]}{letter}", str(hosts[i]),
                              str(d / "ray"), str(d / "home"), str(d / "ray-start.log"), cpus_per_node,
                              dict(resources[i]), object_store_mb, str(d / "trace.txt") if trace else None))
        return cls(tag, root, str(net), GCS_PORT, secrets.token_hex(32), nodes[0], nodes[1])

    @property
    def nodes(self) -> tuple[Node, Node]:
        return self.head, self.worker

    @property
    def ray_address(self) -> str:
        """The GCS address a driver or `ray.init(address=...)` joins."""
        return f"{self.head.address}:{self.port}"

    @property
    def allow(self) -> list[str]:
        """The networks a trace may reach besides loopback (nettrace `allow`), IPv4-mapped form included."""
        net = ipaddress.IPv4Network(self.subnet)
        return [str(net), f"::ffff:{net.network_address}/{96 + net.prefixlen}"]

    def env(self) -> dict[str, str]:
        """What a process inside a namespace needs to join this cluster as a driver."""
        return {**multi_node_env(), "RAY_ADDRESS": self.ray_address, "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": self.token}

    def command_in(self, netns: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", netns, *argv]

    def _full_env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**os.environ, **self.env(), **(env or {})}

    def run_in(self, netns: str, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 120,
               cwd: str | Path | None = None, check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run argv inside `netns` with this environment, `self.env()` and `env` on top; output captured."""
        return subprocess.run(self.command_in(netns, argv), env=self._full_env(env), cwd=cwd, capture_output=True,
                              text=True, timeout=timeout, check=check, stdin=subprocess.DEVNULL)

    def popen_in(self, netns: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None, **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start argv inside `netns` (a long-running driver such as the trainer); `stop` ends it with the rest.
        `kwargs` go to Popen (stdout=..., start_new_session=...)."""
        popen: subprocess.Popen[bytes] = subprocess.Popen(self.command_in(netns, argv), env=self._full_env(env),
                                                          cwd=cwd, stdin=subprocess.DEVNULL, **kwargs)
        return popen

    def run_traced_in(self, netns: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
                      timeout: float = 120, cwd: str | Path | None = None,
                      ) -> tuple[NetTrace, subprocess.CompletedProcess[str]]:
        """`run_in` under strace (hack/nettrace.py's syscalls, the whole process tree): (its trace, the process)."""
        with tempfile.TemporaryDirectory(prefix="kora-nettrace-") as tmp:
            out = Path(tmp) / "trace.txt"
            proc = subprocess.run(self.command_in(netns, [*_strace(out), *argv]), env=self._full_env(env), cwd=cwd,
                                  capture_output=True, text=True, timeout=timeout, check=False,
                                  stdin=subprocess.DEVNULL)
            return judge_trace(out.read_text(errors="replace"), self.allow), proc

    # -- building --------------------------------------------------------------------------------------------

    def start(self, timeout: float = 90) -> NetnsCluster:
        """Make the namespaces and the veth pair, start both nodes, wait until Ray reports both alive (each wait
        bounded by `timeout`). The worker starts as soon as the head's GCS listens, so the two starts overlap.
        On any failure everything made so far is taken away again before the error is raised."""
        try:
            self._make_network()
            self._launch(self.head, ["--head", f"--port={self.port}", "--include-dashboard=false"])
            self._wait(self._gcs_listening, f"the head's GCS to listen on port {self.port}", timeout)
            self._launch(self.worker, [f"--address={self.ray_address}"])
            self._wait(lambda: "Ray runtime started." in Path(self.head.log).read_text(errors="replace"),
                       f"`ray start` of the head node in {self.head.netns} (log {self.head.log})", timeout)
            self.alive = self._wait_alive(timeout)
        except BaseException as exc:
            try:
                self.stop()
            except Exception as cleanup:
                exc.add_note(f"and taking the half-made cluster away failed too: {cleanup}")
            raise
        return self

    def _make_network(self) -> None:
        prefix = ipaddress.IPv4Network(self.subnet).prefixlen
        for node in self.nodes:
            ip("netns", "add", node.netns)
            self.made.append(node.netns)
            self.inodes.append(netns_inode(node.netns) or 0)
        # made inside the namespaces: the pair never shows in the machine's own
        ip("link", "add", self.head.veth, "netns", self.head.netns, "type", "veth",
           "peer", "name", self.worker.veth, "netns", self.worker.netns)
        for node in self.nodes:
            ip("-n", node.netns, "addr", "add", f"{node.address}/{prefix}", "dev", node.veth)
            ip("-n", node.netns, "link", "set", "lo", "up")
            ip("-n", node.netns, "link", "set", node.veth, "up")

    def _launch(self, node: Node, role_args: list[str]) -> None:
        """`ray start --block` of one node inside its namespace, in a session of its own."""
        home = ray_home(node.home)
        Path(node.temp_dir).mkdir(parents=True)
        cmd = [RAY, "start", "--block", *role_args, f"--node-ip-address={node.address}", f"--temp-dir={node.temp_dir}",
               f"--num-cpus={node.num_cpus:g}", f"--resources={json.dumps(node.resources)}",
               f"--object-store-memory={node.object_store_mb * 2**20}", "--disable-usage-stats"]
        if node.trace_file is not None:
            cmd = [*_strace(Path(node.trace_file)), *cmd]
        env = {**os.environ, **multi_node_env(), "HOME": str(home), "RAY_AUTH_MODE": "token",
               "RAY_AUTH_TOKEN": self.token}
        env.pop("RAY_ADDRESS", None)
        with open(node.log, "wb") as fh:
            popen = subprocess.Popen(self.command_in(node.netns, cmd), stdin=subprocess.DEVNULL, stdout=fh,
                                     stderr=subprocess.STDOUT, env=env, cwd=node.temp_dir, start_new_session=True)
        self._popens[node.role] = popen
        node.pid, node.start_time = popen.pid, proc_start_time(popen.pid)

    def _wait(self, ready: Callable[[], object], what: str, timeout: float) -> None:
        """Wait for `ready`, or for a `ray start` to exit (then raise at once, with its log)."""
        wait_for(lambda: any(p.poll() is not None for p in self._popens.values()) or ready(), timeout=timeout,
                 interval=0.2, what=what)
        for role, popen in self._popens.items():
            if popen.poll() is not None:
                node = self.head if role == "head" else self.worker
                raise RuntimeError(f"`ray start` of the {role} node in {node.netns} exited {popen.returncode}; log:\n"
                                   f"{Path(node.log).read_text(errors='replace')[-3000:]}")

    def _gcs_listening(self) -> bool:
        """A listening socket on the GCS port in A: /proc/<pid>/net of the head's `ray start`, once that process
        is in A (before `ip netns exec` has entered A, the same pid shows the machine's own tables)."""
        proc = Path(f"/proc/{self.head.pid}")
        if os.readlink(proc / "ns" / "net") != f"net:[{self.inodes[0]}]":
            return False
        port = f":{self.port:04X}"
        for table in ("tcp", "tcp6"):
            rows = [r.split() for r in (proc / "net" / table).read_text().splitlines()[1:]]
            if any(r[1].endswith(port) and r[3] == "0A" for r in rows):  # 0A: LISTEN
                return True
        return False

    def _wait_alive(self, timeout: float) -> list[dict[str, object]]:
        """Until Ray, asked from inside A, reports both nodes alive (or a `ray start` exits); what it reported."""
        out = Path(self.root) / "probe.out"
        with open(out, "wb") as fh:
            probe = self.popen_in(self.head.netns, [sys.executable, __file__, "probe", "--expect", "2",
                                                    "--timeout", str(timeout)], stdout=fh, stderr=subprocess.STDOUT)
        try:
            self._wait(lambda: probe.poll() is not None, "Ray to report both nodes alive", timeout + 30)
        finally:
            if probe.poll() is None:
                probe.kill()
            probe.wait()
        text = out.read_text(errors="replace")
        if probe.returncode != 0:
            raise RuntimeError(f"Ray did not report both nodes alive:\n{text[-3000:]}")
        nodes: list[dict[str, object]] = json.loads(text.strip().splitlines()[-1])
        return nodes

    # -- taking it away --------------------------------------------------------------------------------------

    def stop(self, timeout: float = 45) -> None:
        """SIGTERM each `ray start`, SIGKILL what is left in the namespaces, delete them and the temp dirs.
        Idempotent; safe on a cluster that was only half made. Raises when something survived."""
        self.ended += [p for n in self.nodes for p in netns_pids(n.netns) if p not in self.ended]
        ray_starts = [p for node in self.nodes for p in node.ray_start_pids()]
        for pid in ray_starts:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            # each drains its node (Ray allows 30 s) and stops its processes
            wait_for(lambda: not any(pid_alive(p) for p in ray_starts), timeout=timeout, interval=0.2,
                     what="the `ray start` processes to stop their nodes")
        self._kill_the_rest()
        for popen in self._popens.values():  # reap them: dead, they are zombies of ours until waited for
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)
        self._collect_traces()
        for name in self.made:
            ip("netns", "delete", name, check=False)  # the veth pair goes with its namespaces
        self.made.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        left = self.leftovers()
        if left:
            raise RuntimeError(f"the namespaced Ray cluster {self.tag} left {left}")

    def _kill_the_rest(self) -> None:
        def rest() -> list[int]:
            return sorted(set(pids_in_inodes(self.inodes)) | {p for n in self.nodes for p in netns_pids(n.netns)})

        def killed() -> bool:
            left = rest()
            self.ended += [p for p in left if p not in self.ended]
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return not left

        wait_for(killed, timeout=20, interval=0.2, what=f"the processes in {[n.netns for n in self.nodes]} to die")

    def _collect_traces(self) -> None:
        for node in self.nodes:
            if node.trace_file and Path(node.trace_file).exists():
                self.traces[node.role] = judge_trace(Path(node.trace_file).read_text(errors="replace"), self.allow)

    def leftovers(self) -> dict[str, list[str]]:
        """What of this cluster still exists: namespaces, veth ends, processes, its temp root. Empty after stop."""
        left: dict[str, list[str]] = {}
        names = [n.netns for n in self.nodes]
        if ns := [n for n in netns_list() if n in names and netns_inode(n) in self.inodes]:
            left["namespaces"] = ns
        if veths := [n.veth for n in self.nodes if ip("link", "show", n.veth, check=False).returncode == 0]:
            left["veth"] = veths
        if pids := pids_in_inodes([i for i in self.inodes if i]):
            left["pids"] = [str(p) for p in pids]
        if Path(self.root).exists():
            left["dirs"] = [self.root]
        return left

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)
                                   if f.name not in ("traces", "ended", "_popens")}
        data["head"], data["worker"] = asdict(self.head), asdict(self.worker)
        return data

    @classmethod
    def from_json(cls, data: dict[str, object]) -> NetnsCluster:
        rest = dict(data)
        head, worker = (Node(**rest.pop(k)) for k in ("head", "worker"))  # type: ignore[arg-type]
        return cls(head=head, worker=worker, **rest)  # type: ignore[arg-type]


def _strace(out: Path) -> list[str]:
    # --seccomp-bpf: only the traced syscalls stop the tracee, so Ray's busy C++ processes stay fast
    return [strace_path(), "-f", "--seccomp-bpf", "-qq", "-Y", "-s", "256", "-e", f"trace={SYSCALLS}",
            "-e", "signal=none", "-o", str(out)]


@contextlib.contextmanager
def two_node_cluster(cpus_per_node: float = 1, resources: Sequence[Mapping[str, float]] = ({}, {}),
                     trace: bool = False, object_store_mb: int = 300, timeout: float = 90) -> Iterator[NetnsCluster]:
    """A started two-node cluster (head in `.head.netns`, worker in `.worker.netns`); stopped after, also on
    failure. `resources`: the custom resources of the head and of the worker. `trace`: run both nodes under
    strace; `cluster.traces` holds the verdicts once `stop()` ran."""
    cluster = NetnsCluster.create(cpus_per_node, resources, trace, object_store_mb).start(timeout)
    try:
        yield cluster
    finally:
        cluster.stop()


SMOKE_DRIVER = """
import json, ray
ray.init(log_to_driver=False)
where = ray.remote(num_cpus=0)(lambda: ray.util.get_node_ip_address())
nodes = [n for n in ray.nodes() if n["Alive"]]
ips = ray.get([where.options(resources={f"node:{n['NodeManagerAddress']}": 0.01}).remote() for n in nodes])
print(json.dumps(sorted(ips)))
"""


def _probe(expect: int, timeout: float) -> int:
    """(inside A) Poll Ray's node table until `expect` nodes are alive; print them as JSON."""
    import logging

    import ray

    ray.init(log_to_driver=False, logging_level=logging.WARNING)
    alive: list[dict[str, object]] = []

    def enough() -> bool:
        alive[:] = [{"node_id": n["NodeID"], "address": n["NodeManagerAddress"], "resources": n["Resources"]}
                    for n in ray.nodes() if n["Alive"]]
        return len(alive) >= expect

    wait_for(enough, timeout=timeout, interval=0.5, what=f"{expect} alive Ray nodes")
    print(json.dumps(alive))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["up", "down", "smoke", "probe"], help="probe: run inside A by `start`")
    p.add_argument("--cpus-per-node", type=float, default=1)
    p.add_argument("--state-dir", type=Path, default=STATE_DIR)
    p.add_argument("--expect", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=90)
    args = p.parse_args(argv)
    state = args.state_dir / "cluster.json"
    if args.action == "probe":
        return _probe(args.expect, args.timeout)
    if args.action == "smoke":
        with two_node_cluster(args.cpus_per_node, timeout=args.timeout) as cluster:
            proc = cluster.run_in(cluster.head.netns, [sys.executable, "-c", SMOKE_DRIVER], timeout=args.timeout)
        print(proc.stdout + proc.stderr[-3000:] if proc.returncode else proc.stdout, end="")
        return proc.returncode
    if args.action == "up":
        if state.exists():
            raise SystemExit(f"a cluster is up already ({state}): `down` first")
        cluster = NetnsCluster.create(args.cpus_per_node).start(args.timeout)
        args.state_dir.mkdir(parents=True, exist_ok=True)
        state.touch(mode=0o600)  # it and the env file hold the token
        state.write_text(json.dumps(cluster.to_json()))
        env_file = args.state_dir / "env"
        env_file.touch(mode=0o600)
        env_file.write_text("".join(f"{k}={v}\n" for k, v in cluster.env().items()))
        print(f"Ray at {cluster.ray_address}; a driver: ip netns exec {cluster.head.netns} env $(cat {env_file}) "
              f"{sys.executable} DRIVER.py")
        return 0
    if state.exists():
        NetnsCluster.from_json(json.loads(state.read_text())).stop()
        state.unlink()
        (args.state_dir / "env").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
