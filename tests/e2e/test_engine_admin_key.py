"""The engines' admin key end to end: the operator makes a KubeRay job's key Secret on the real API server; an
engine started with that key in its environment, as the RayJob's pods get it (secretKeyRef into
KORA_ENGINE_ADMIN_API_KEY), refuses a weight route called without the key or with another one (401) and
serves it with the key. Every part is real: kube-apiserver, etcd, `kora operator`, the reference engine
(`python -m kora_engine.lm`) and HTTP on 127.0.0.1.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import requests

from engine_helpers import start_engine, stop_engine
from kora_trainer.wire.engine_auth import ADMIN_API_KEY_ENV, new_admin_key
from localcluster import wait_for
from operatorkit import Operator, apply, children, kora_namespace, local_cluster
from specs import valid_job
from tinymodel import make_tiny_model

pytestmark = pytest.mark.timeout(300)
LOGS = Path("/tmp/kora-logs")
VERSION = {"new_version": "v-admin-key"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("kora-cluster")) as c:
        yield c


def test_an_engine_refuses_its_weight_routes_without_the_operators_key(cluster, tmp_path):
    with kora_namespace(cluster, "e2e-key") as ns, Operator(cluster, [ns], LOGS / f"operator-{ns}.log").running():
        apply(cluster, valid_job("guarded"), ns)
        (secret,) = wait_for(lambda: [s for s in children(cluster, "guarded", ns)["Secret"]
                                      if s["metadata"]["name"] == "guarded-engine-admin-key"],
                             timeout=30, what="the job's engine admin key Secret")
    key = base64.b64decode(secret["data"]["key"]).decode()
    engine = start_engine(make_tiny_model(tmp_path / "tiny"), tmp_path, env={ADMIN_API_KEY_ENV: key})
    try:
        route = engine.url + "/update_weight_version"

        def post(**headers: str) -> requests.Response:
            return requests.post(route, json=VERSION, headers=headers, timeout=30)

        for refused in (post(), post(Authorization=f"Bearer {new_admin_key()}"), post(**{"x-api-key": "guess"})):
            assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
        assert post(Authorization=f"Bearer {key}").status_code == 200
        assert requests.get(engine.url + "/health", timeout=30).status_code == 200  # probes need no key
    finally:
        stop_engine(engine)
