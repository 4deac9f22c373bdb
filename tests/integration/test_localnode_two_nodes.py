"""Two real nodes (hack/localnode.py, the second in a network namespace of ours): a pod on one node reaches
a Service whose pod runs on the other, by its DNS name, both ways; `down` leaves nothing. Root only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import localnode
from localcluster import LocalCluster
from nodekit import node_cluster, probe_client, probe_server, wait_pod_phase, wait_pod_ready

# `full`: a further case of the path test_localnode.py runs in `make test` (same build, ~80 s more)
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.full]
NODES = [localnode.NodeSpec(0).name, localnode.NodeSpec(1).name]


@pytest.fixture(scope="module")
def nc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with node_cluster(tmp_path_factory.mktemp("kora-nodes"), nodes=2) as c:
        yield c


def test_both_nodes_ready(nc: LocalCluster) -> None:
    for name in NODES:
        assert localnode.node_ready(nc, name), nc.kubectl("describe", "node", name, check=False).stdout
    ip = nc.kubectl("get", "node", NODES[1], "-o", 'jsonpath={.status.addresses[?(@.type=="InternalIP")].address}')
    assert ip.stdout == localnode.NodeSpec(1).node_ip


@pytest.mark.parametrize(("server_node", "client_node"), [(0, 1), (1, 0)], ids=["1-to-2", "2-to-1"])
def test_service_across_nodes(nc: LocalCluster, server_node: int, client_node: int) -> None:
    ns = f"across-{server_node}{client_node}"
    nc.kubectl("create", "namespace", ns)
    nc.kubectl("-n", ns, "apply", "-f", "-", input=probe_server("web", node=NODES[server_node]))
    server = wait_pod_ready(nc, ns, "web")
    assert server["status"]["podIP"].startswith(f"10.213.{server_node}.")
    nc.kubectl("-n", ns, "expose", "pod", "web", "--port=80", "--target-port=8080", "--name=web")
    url = f"http://web.{ns}.svc.{localnode.CLUSTER_DOMAIN}/"
    nc.kubectl("-n", ns, "apply", "-f", "-", input=probe_client("client", url, node=NODES[client_node]))
    client = wait_pod_phase(nc, ns, "client", "Succeeded", timeout=150)
    assert client["status"]["podIP"].startswith(f"10.213.{client_node}.")
    assert "hello from web" in nc.kubectl("-n", ns, "logs", "client").stdout


def test_down_leaves_nothing(nc: LocalCluster) -> None:
    assert any(f"netns {NODES[1]}" == x for x in localnode.leftovers(nc.state_dir))
    nc.stop()
    assert localnode.leftovers(nc.state_dir) == []
