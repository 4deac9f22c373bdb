"""A Ray cluster of two nodes on one machine, each in a network namespace of its own (hack/netns_cluster.py): a
driver inside the head's namespace sees both nodes at their namespace addresses, places a task on each, and
services bound to one node's address answer the other node; nothing of it reaches past the namespaces'
subnet (strace, hack/nettrace.py, on the driver and on both nodes' whole process trees); and nothing of it is
left afterwards, also when a node fails to start.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from pathlib import Path

import pytest

from netns_cluster import NetnsCluster, NetTrace
from netnskit import host_addresses, netns_unavailable, two_node_ray  # noqa: F401 (netnskit's fixture)

pytestmark = pytest.mark.slow

RESOURCES = ({"kora_a": 1}, {"kora_b": 1})

DRIVER = r"""
import json, socket
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init(log_to_driver=False)  # RAY_ADDRESS, the token: cluster.env()
me = ray.util.get_node_ip_address()
nodes = [{"id": n["NodeID"], "ip": n["NodeManagerAddress"], "head": "node:__internal_head__" in n["Resources"]}
         for n in ray.nodes() if n["Alive"]]

@ray.remote(num_cpus=0)
def where():
    return [ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()]

by_resource = ray.get([where.options(resources={r: 0.01}).remote() for r in ("kora_a", "kora_b")])
by_affinity = ray.get([where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["id"], soft=False)).remote()
                       for n in nodes])

# B -> A: a task on B connects to a listener on this driver's address
server = socket.create_server((me, 0))
server.settimeout(60)

@ray.remote(num_cpus=0, resources={"kora_b": 0.01})
def call(host, port):
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(ray.util.get_node_ip_address().encode())

sent = call.remote(me, server.getsockname()[1])
conn, peer = server.accept()
b_to_a = {"said": conn.recv(64).decode(), "peer": peer[0]}
conn.close()
ray.get(sent)

# A -> B: this driver connects to a listener an actor on B holds on its node's address
@ray.remote(num_cpus=0, resources={"kora_b": 0.01})
class Listener:
    def __init__(self):
        self.server = socket.create_server((ray.util.get_node_ip_address(), 0))
        self.server.settimeout(60)
    def address(self):
        return list(self.server.getsockname()[:2])
    def accept(self):
        conn, peer = self.server.accept()
        said = conn.recv(64).decode()
        conn.close()
        return {"said": said, "peer": peer[0]}

listener = Listener.remote()
host, port = ray.get(listener.address.remote())
accepted = listener.accept.remote()
with socket.create_connection((host, port), timeout=30) as s:
    s.sendall(me.encode())
a_to_b = ray.get(accepted)
print(json.dumps({"me": me, "nodes": nodes, "by_resource": by_resource, "by_affinity": by_affinity,
                  "b_to_a": b_to_a, "a_to_b": a_to_b, "listener": host}))
"""


def _netns(ns: str, *args: str) -> str:
    return subprocess.run(["ip", "-n", ns, *args], capture_output=True, text=True, timeout=30, check=True).stdout


def _assert_contained(what: str, trace: NetTrace) -> None:
    assert trace.sent.counts["allowed"] > 0, f"{what}: strace saw no traffic on the namespaces' subnet at all"
    assert not trace.sent.foreign, f"{what}:\n{trace.report()}"
    assert not trace.unexpected_unreachable(), f"{what} tried more than Ray's node-address probe:\n{trace.report()}"


@pytest.mark.parametrize("two_node_ray", [{"resources": RESOURCES, "trace": True}], indirect=True, ids=["traced"])
def test_a_driver_in_a_uses_both_nodes_and_nothing_leaves(two_node_ray: NetnsCluster, tmp_path: Path) -> None:  # noqa: F811
    c = two_node_ray
    a, b = c.head.address, c.worker.address
    subnet = ipaddress.ip_network(c.subnet)
    assert {ipaddress.ip_address(a), ipaddress.ip_address(b)} <= set(subnet.hosts())
    assert not {a, b} & host_addresses(), "a Ray node uses the machine's own address"
    # only the pair's subnet is routed in either namespace, and only lo and its veth end are there
    for node in c.nodes:
        assert _netns(node.netns, "-4", "route").split()[0] == c.subnet
        assert len(_netns(node.netns, "-4", "route").strip().splitlines()) == 1, _netns(node.netns, "route")
        links = [line.split(":")[1].strip().split("@")[0] for line in _netns(node.netns, "-o", "link").splitlines()]
        assert sorted(links) == sorted(["lo", node.veth])

    (tmp_path / "driver.py").write_text(DRIVER)
    trace, proc = c.run_traced_in(c.head.netns, [sys.executable, str(tmp_path / "driver.py")], cwd=tmp_path,
                                  timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    ids = {n["ip"]: n["id"] for n in seen["nodes"]}
    assert sorted(ids) == sorted([a, b]) and [n["ip"] for n in seen["nodes"] if n["head"]] == [a]
    assert seen["me"] == a, "the driver is not on the head's node"
    assert seen["by_resource"] == [[ids[a], a], [ids[b], b]]
    assert sorted(ip for _, ip in seen["by_affinity"]) == sorted([a, b])
    assert seen["b_to_a"] == {"said": b, "peer": b}, "a task on B did not reach a service on A's address"
    assert seen["listener"] == b and seen["a_to_b"] == {"said": a, "peer": a}, "A did not reach a service on B"
    _assert_contained("the driver", trace)

    c.stop()  # the nodes' traces are complete once their processes are gone; the fixture checks what is left
    assert c.leftovers() == {}
    assert set(c.traces) == {"head", "worker"}
    for role, node_trace in c.traces.items():
        _assert_contained(f"the {role} node's Ray processes", node_trace)
    print("\n".join(f"{role}: {t.report()}" for role, t in [("driver", trace), *c.traces.items()]))


def test_a_node_that_fails_to_start_takes_the_whole_cluster_with_it() -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    # Ray refuses CPU among the custom resources: the worker's `ray start` exits while the head is still starting
    cluster = NetnsCluster.create(resources=({}, {"CPU": 1}))
    with pytest.raises(RuntimeError, match=r"worker node .* exited"):
        cluster.start(timeout=60)
    assert cluster.head.pid in cluster.ended, "the head's `ray start` was not running any more when stop() came"
    assert len(cluster.ended) > 1, "the head had started no Ray process yet: this did not take a live node away"
    assert cluster.leftovers() == {}
