#!/usr/bin/env python3
"""Run a command under `strace -f` and list every network destination its process tree reached.

    python hack/nettrace.py [--allow 10.77.0.0/16] [--keep TRACE] -- COMMAND [ARG ...]

Traces connect, sendto, sendmsg and sendmmsg (a DNS query over UDP may be a sendto without a connect)
and exec/fork to name each process. A destination counts as local when it is a unix socket, a netlink
socket (the kernel), or a loopback address; `--allow` adds networks (the namespaces a multi-node
test made). It prints one line per foreign destination with the process that reached it and exits
1 when there was any, otherwise the command's own exit status. Tests import `run_traced`.

One kind of DNS traffic is counted apart, as `loopback-ptr`, and not as foreign: a socket to port 53
whose every query is the reverse lookup of a 127.x address. A socket is followed by its inode (strace -y),
not by its fd number: a process reuses the number of a closed resolver socket for its next socket, whose
sends are not DNS questions. Every foreign DNS socket is reported with the names it asked for.

torch's c10d TCPStore client makes one loopback reverse lookup per connection (it names its peer with
getnameinfo without NI_NUMERICHOST, and the peer it connected to is the IPv4-mapped ::ffff:127.0.0.1,
which /etc/hosts does not list); torch offers no switch for it.

A UDP socket connected to port 53 that sends nothing is counted apart too, as `udp-route-probe`: connect() on a UDP
socket only asks the kernel for a route (no datagram leaves), which is how Ray finds its node IP (a connect to
8.8.8.8:53, then getsockname). The socket must be seen made as SOCK_DGRAM (strace -y names its inode) and no
sendto/sendmsg/sendmmsg on it seen; a write() on it is not traced (glibc's resolver and Ray send with sendto/sendmmsg).
"""

from __future__ import annotations

import argparse
import codecs
import ipaddress
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

SYSCALLS = "socket,connect,sendto,sendmsg,sendmmsg,execve,clone,clone3,fork,vfork"
# a UDP socket as strace -y shows its creation: its inode, to tell a route probe from a DNS socket (see parse)
_DGRAM = re.compile(r"^socket\(AF_INET6?, SOCK_DGRAM\b[^)]*\)\s+=\s+\d+<(socket:\[\d+\])>")
_PID = re.compile(r"^(\d+)(?:<([^>]*)>)?\s+(.*)$")
_EXEC = re.compile(r'^execve\("[^"]*", \[(.*?)\]')
_CHILD = re.compile(r"^(?:clone3?|v?fork)\(.*\)\s+=\s+(\d+)")
_FAMILY = re.compile(r"sa_family=(AF_\w+)")
_INET = re.compile(r'sin_port=htons\((\d+)\), sin_addr=inet_addr\("([^"]+)"\)')
_INET6 = re.compile(r'sin6_port=htons\((\d+)\).*?inet_pton\(AF_INET6, "([^"]+)"')
# the socket argument: its number and, with strace -y, what it is (socket:[inode])
_FD = re.compile(r"^\w+\((\d+)(?:<([^>]*)>)?,")
_PAYLOAD = re.compile(r'"((?:[^"\\]|\\.)*)"')


@dataclass
class Trace:
    """What one traced run reached: counts per kind, and every foreign destination with its process."""

    returncode: int
    counts: Counter[str] = field(default_factory=Counter)  # "loopback", "unix", "netlink", "allowed", "foreign"
    foreign: list[tuple[int, str, str]] = field(default_factory=list)  # (pid, process, "addr:port")

    def report(self) -> str:
        head = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())) or "no socket calls"
        lines = [f"network calls: {head}"]
        lines += [f"  FOREIGN {dest} from pid {pid} ({proc})" for pid, proc, dest in self.foreign]
        return "\n".join(lines)


def _destination(call: str) -> tuple[str, str] | None:
    """(kind, address) of the sockaddr in one connect/sendto/sendmsg line, None when it names none."""
    fam = _FAMILY.search(call)
    if fam is None:
        return None  # sendto/sendmsg on a connected socket: its connect was already counted
    family = fam.group(1)
    if family == "AF_UNIX":
        return "unix", ""
    if family == "AF_NETLINK":
        return "netlink", ""
    if family == "AF_UNSPEC":
        return None  # connect(AF_UNSPEC) dissolves a UDP association: no destination
    m = _INET.search(call) or _INET6.search(call)
    if m is None:
        return "foreign", f"{family} {call[:120]}"  # a family we do not parse is not assumed local
    return "inet", f"{m.group(2)}:{m.group(1)}"


def _classify(addr: str, allow: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> str:
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(addr.rsplit(":", 1)[0])
    if ip.version == 6 and ip.ipv4_mapped:  # ::ffff:a.b.c.d (a dual-stack socket, as Ray's) is a.b.c.d
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    return "allowed" if any(ip in net for net in allow) else "foreign"


def _unescape(text: str) -> bytes:
    """The bytes of a string as strace prints it: C escapes (\\NNN octal, \\n, \\", ...), which are Python's too."""
    return codecs.escape_decode(text.encode("latin-1", "replace"))[0]


def dns_questions(call: str) -> list[str]:
    """The names asked in the DNS queries one send line carries (sendmmsg may carry two: A and AAAA)."""
    names = []
    for raw in _PAYLOAD.findall(call):
        msg, labels, i = _unescape(raw), [], 12  # the question follows the 12-byte header
        while i < len(msg) and msg[i] != 0:
            labels.append(msg[i + 1:i + 1 + msg[i]].decode("ascii", "replace"))
            i += 1 + msg[i]
        if len(msg) > 12:
            names.append(".".join(labels) + ".")
    return names


def _is_loopback_ptr(name: str) -> bool:
    return name.endswith(".127.in-addr.arpa.") and name.count(".") == 6


def parse(text: str, allow: list[ipaddress.IPv4Network | ipaddress.IPv6Network], returncode: int = 0) -> Trace:
    trace = Trace(returncode)
    names: dict[int, str] = {}
    # resolver socket -> (pid, process, resolver address, the names it asked); judged once the trace is read
    dns: dict[object, tuple[int, str, str, list[str]]] = {}
    dgram: set[str] = set()  # the inodes of UDP sockets
    for raw in text.splitlines():
        m = _PID.match(raw)
        if m is None:
            continue
        pid, comm, call = int(m.group(1)), m.group(2) or "", m.group(3)
        if (ex := _EXEC.match(call)) and "= 0" in call.rsplit(")", 1)[-1]:
            names[pid] = " ".join(a.strip('"') for a in ex.group(1).split(", ")[:6])[:160]
            continue
        if child := _CHILD.match(call):
            names.setdefault(int(child.group(1)), names.get(pid, comm))
            continue
        if dg := _DGRAM.match(call):
            dgram.add(dg.group(1))
            continue
        if not call.startswith(("connect(", "sendto(", "sendmsg(", "sendmmsg(")):
            continue
        fd = _FD.match(call)
        # the inode when strace -y names the socket (unique while the trace runs), else (thread, number)
        key: object = fd.group(2) if fd and (fd.group(2) or "").startswith("socket:") else \
            (pid, int(fd.group(1)) if fd else -1)
        if key in dns and not call.startswith("connect("):
            dns[key][3].extend(dns_questions(call) or ["(not a DNS query)"])
            continue
        dest = _destination(call)
        if dest is None:
            continue
        kind, addr = dest
        if kind == "inet":
            kind = _classify(addr, allow)
            if kind == "foreign" and addr.endswith(":53") and call.startswith("connect("):
                dns.setdefault(key, (pid, f"{comm}: {names.get(pid, '?')}", addr, []))  # judged by what it asks
                continue
        trace.counts[kind] += 1
        if kind == "foreign":
            trace.foreign.append((pid, f"{comm}: {names.get(pid, '?')}", addr))
    for key, (pid, proc, addr, asked) in dns.items():
        if asked and all(_is_loopback_ptr(n) for n in asked):
            trace.counts["loopback-ptr"] += 1
        elif not asked and key in dgram:
            trace.counts["udp-route-probe"] += 1
        else:
            trace.counts["foreign"] += 1
            trace.foreign.append((pid, proc, f"{addr} (DNS: {', '.join(asked) or 'no query seen'})"))
    return trace


def strace_path() -> str:
    found = shutil.which("strace")
    if found is None:
        raise FileNotFoundError("strace is not installed: run `bash hack/install_tools.sh` (make setup does)")
    return found


def run_traced(cmd: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
               allow: Sequence[str] = (), timeout: float = 600, keep: Path | None = None) -> tuple[Trace, str]:
    """Run cmd under strace; returns (trace, the command's stdout+stderr)."""
    with tempfile.TemporaryDirectory(prefix="kora-nettrace-") as tmp:
        out = keep or Path(tmp) / "trace.txt"
        argv = [strace_path(), "-f", "-qq", "-Y", "-y", "-s", "256", "-e", f"trace={SYSCALLS}", "-o", str(out), *cmd]
        proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
        nets = [ipaddress.ip_network(a, strict=False) for a in allow]
        return parse(out.read_text(errors="replace"), nets, proc.returncode), proc.stdout + proc.stderr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--allow", action="append", default=[], help="a network that counts as local (CIDR)")
    p.add_argument("--keep", type=Path, help="keep the raw strace output here")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given")
    trace, output = run_traced(cmd, allow=args.allow, keep=args.keep, timeout=3600)
    sys.stdout.write(output)
    print(trace.report())
    return 1 if trace.foreign else trace.returncode


if __name__ == "__main__":
    raise SystemExit(main())
