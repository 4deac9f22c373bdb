"""Fixtures for tests against a real local control plane (etcd + kube-apiserver +
kube-controller-manager on 127.0.0.1, started by hack/localcluster.py).

If the pinned binaries cannot be provided, the tests fail with hack/testbin.sh's error; they are
skipped only when KORA_SKIP_CLUSTER=1 says so.

Runtime-Ray modules also get, one per module: `head` (a real local Ray head), `control_port`, `ns`
(a namespace with the CRDs installed) and `ray_operator` (`kora operator` submitting the scripted
trainer to `head`). Their bodies live in tests/operatorkit.py and tests/raykit.py, which tests/e2e
uses too; a module may override any of them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from localcluster import LocalCluster, free_ports
from localray import LocalRay
from operatorkit import Operator, kora_namespace, local_cluster
from raykit import ray_head
from raykit import ray_operator as ray_operator_running

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # everything under tests/integration/ runs against the local cluster: `-m "not cluster"` skips it
    for item in items:
        if item.path.resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("kora-cluster")) as c:
        yield c


@pytest.fixture(scope="session")
def kubectl(cluster: LocalCluster) -> Callable[..., CompletedProcess[str]]:
    return cluster.kubectl


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def ns(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """The module's namespace (named after it), with our CRDs and KubeRay's installed."""
    prefix = request.module.__name__.rpartition(".")[2].removeprefix("test_").replace("_", "-")[:40]
    with kora_namespace(cluster, prefix) as name:
        yield name


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRay]:
    with ray_head(tmp_path_factory.mktemp("ray-cwd")) as h:
        yield h


@pytest.fixture(scope="module")
def control_port() -> int:
    """The one port the module's trainers serve their control plane on (KORA_RAY_CONTROL_PORTS)."""
    return free_ports(1)[0]


@pytest.fixture(scope="module")
def ray_operator(cluster: LocalCluster, ns: str, head: LocalRay, control_port: int) -> Iterator[Operator]:
    with ray_operator_running(cluster, ns, head, control_port) as op:
        yield op
