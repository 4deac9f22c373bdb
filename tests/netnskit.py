"""Two Ray nodes in two network namespaces (hack/netns_cluster.py) for tests, skipped with the reason where this
machine cannot make namespaces (not root, no `ip`, the kernel refuses).

    def test_x(two_node_ray):                                  # a started cluster, taken away after the test
        c = two_node_ray
        p = c.run_in(c.head.netns, [sys.executable, "driver.py"], timeout=120)   # RAY_ADDRESS etc. set

    @pytest.mark.parametrize("two_node_ray", [{"trace": True, "resources": ({"a": 1}, {"b": 1})}], indirect=True)

The parameters are `two_node_cluster`'s keywords (cpus_per_node, resources, trace, object_store_mb, timeout).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from netns_cluster import NetnsCluster


@functools.cache
def netns_unavailable() -> str | None:
    """Why no network namespace can be made here, or None when one can (tried once: add, then delete)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"kora-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=30, check=False)
    return None


def host_addresses() -> set[str]:
    """The machine's own addresses (its root network namespace), which no Ray node of a test may use."""
    out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=30, check=True).stdout
    return {line.split()[3].split("/")[0] for line in out.splitlines()}


@pytest.fixture
def two_node_ray(request: pytest.FixtureRequest) -> Iterator[NetnsCluster]:
    """A started two-node Ray cluster in namespaces (head `.head.netns`, worker `.worker.netns`). After the
    test it is stopped (a test may stop it first, to read `.traces`), and nothing of it may remain."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    options = dict(getattr(request, "param", {}))
    timeout = options.pop("timeout", 90)
    cluster = NetnsCluster.create(**options).start(timeout)
    try:
        yield cluster
    finally:
        cluster.stop()
    assert cluster.leftovers() == {}
