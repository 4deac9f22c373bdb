"""Fixtures for tests against a real local control plane (etcd + kube-apiserver +
kube-controller-manager on 127.0.0.1, started by hack/localcluster.py).

If the pinned binaries cannot be provided, the tests fail with hack/testbin.sh's error; they are
skipped only when KORA_SKIP_CLUSTER=1 says so.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from localcluster import LocalCluster

SKIP_ENV = "KORA_SKIP_CLUSTER"
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # everything under tests/integration/ runs against the local cluster: `-m "not cluster"` skips it
    for item in items:
        if item.path.resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: not starting the local kube-apiserver/etcd/controller-manager")
    c = LocalCluster.start(tmp_path_factory.mktemp("kora-cluster"))
    try:
        yield c
    finally:
        c.stop()


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
