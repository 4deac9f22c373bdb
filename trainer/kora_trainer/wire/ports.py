"""Ports for servers that bind later: free now, and outside the range the kernel hands out on its own.

A port from bind(0) comes from the kernel's ephemeral range, the same pool every outgoing connection draws its
local port from; a server that binds it seconds later (an engine after loading its model, an API server after
starting) can find it taken by a connection (a run's Ray workers open many) and fail with EADDRINUSE. These pick a
random port below that range and above Ray's worker ports (else above the range), checked by binding it.
Imports nothing heavy: the test harness (hack/localcluster.py) uses it too.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_FLOOR = 20000  # Ray's workers listen on 10002-19999 by default (min/max_worker_port)


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", taken: frozenset[int] = frozenset()) -> int:
    """A port free now on `host` (and not in `taken`)."""
    lo, hi = _ephemeral_range()
    span = range(PORT_FLOOR, lo) if lo - PORT_FLOOR >= 1000 else range(hi + 1, 65536)
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.choice(span)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try taken: the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports on `host`."""
    ports: list[int] = []
    while len(ports) < n:
        ports.append(free_port(host, frozenset(ports)))
    return ports
