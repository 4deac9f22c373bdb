"""The trainer across two Ray nodes for real, on one machine: two network namespaces joined by a veth pair
(hack/netns_cluster.py via tests/netnskit.py), a Ray head in A, a second Ray node in B, each with 1 CPU. The toy at
parallelism.data 2 with 2 engines. Colocate: each rank's bundle (rank + the engine beside it, 0.7 CPU) fits one
node only, so Ray's PACK puts one rank and one engine on each node. Disaggregated: the ranks (0.5 CPU each) fill
one node and the engines go to the other, so rank 0's weight-update group with the engines crosses the veth.
The driver runs in A and joins the cluster by
RAY_ADDRESS, as it does on a KubeRay head pod. The job spans nodes, so the trainer's group meets at rank 0's node
address and the engines bind their node's address (orchestration/addresses.py); nothing binds the machine's own.

Shows: the ranks (and the engines) on different nodes, both engines serving the pushed policy (the
engine-vs-trainer log-prob gap of the sampled tokens, every step), and the reward rising."""

from __future__ import annotations

import json
import os
import sys

import pytest

from netnskit import host_addresses, two_node_ray  # noqa: F401 (netnskit's fixture)
from trainkit import E2E, REPO, TINY, TOY_YAML

STEPS = 14
GAP_MAX = 1e-4


@pytest.fixture
def workers_import_the_tests(monkeypatch):
    """The Ray nodes' workers take the nodes' environment: the custom reward (tests/e2e) must be importable."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "trainer"), str(REPO / "engine"), str(E2E),
                                                      str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.slow
@pytest.mark.parametrize("two_node_ray", [{"cpus_per_node": 1}], indirect=True)
@pytest.mark.parametrize("deployment", ["Colocate", pytest.param("Disaggregated", marks=pytest.mark.full)])
def test_data_2_trains_on_two_nodes(workers_import_the_tests, two_node_ray, toy_dir, tmp_path,  # noqa: F811
                                    deployment):
    c = two_node_ray
    nodes = {c.head.address, c.worker.address}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "kora_trainer.train", "--config", str(TOY_YAML), "--run-dir", str(run_dir),
           "--control-port", "0", f"model.path={toy_dir}", f"data.path={toy_dir}/train.parquet", *TINY,
           "parallelism.data=2", "rollout.numEngines=2", f"deployment.mode={deployment}", "deployment.async=false",
           f"algorithm.numSteps={STEPS}", "algorithm.lr=0.005"]
    out = c.run_in(c.head.netns, cmd, env={"KORA_CONTROL_TOKEN": "test-token"}, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    addresses = {r["rank"]: r["address"] for r in start["ranks"]}
    engine_hosts = [e.split("//")[1].split(":")[0] for e in start["engine_urls"]]
    assert not (set(addresses.values()) | set(engine_hosts)) & host_addresses()  # namespace addresses only
    if deployment == "Colocate":  # a rank and the engine beside it (0.7 CPU) per node
        assert set(addresses.values()) == nodes and set(engine_hosts) == nodes, (addresses, engine_hosts)
    else:  # the two ranks fill one node, the engines the other: the weight-update group spans the nodes
        assert len(set(addresses.values())) == 1 and set(engine_hosts) == nodes - {addresses[0]}, (
            addresses, engine_hosts)
        assert start["transport"] == "distributed"
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == STEPS
    gaps = [e["rollout_logp_gap_max"] for e in steps]
    assert None not in gaps and max(gaps) < GAP_MAX, f"an engine does not serve the trainer's policy: {gaps}"
    rewards = [e["reward_mean"] for e in steps]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first, f"the reward did not rise: {rewards}"
