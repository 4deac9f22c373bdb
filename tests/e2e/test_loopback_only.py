"""Nothing kora starts talks past loopback: one toy step of the real trainer (its private Ray head, the
trainer and rollout actors, the reference engine, the weight-update group) and a `ray start` head of
hack/localray.py running one Ray job, each traced with `strace -f` (hack/nettrace.py). Any destination
other than loopback, a unix socket or netlink fails the test with the process and the address.

What they guard, and the fixes (trainer/kora_trainer/config/ray_env.py): the private head reached over the
machine's own address and Ray's node-address probe toward 8.8.8.8 (Ray read its single-node switch before
kora set it), the dashboard's cloud-metadata probe and DNS lookups, the "usage disabled" report of
`ray start` heads, gloo resolving the hostname, torch's store listening on every interface.
"""

from __future__ import annotations

import os
import sys

import pytest

from nettrace import run_traced
from trainkit import E2E, REPO, train_command

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = {**os.environ, "KORA_CONTROL_TOKEN": "test-token",
           "PYTHONPATH": os.pathsep.join([str(E2E), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    # what the issue traced with: the fix must not depend on the user having opted out of usage stats
    env.pop("RAY_USAGE_STATS_ENABLED", None)
    return env


def _assert_local(trace, output: str) -> None:
    assert trace.returncode == 0, f"the traced command failed (exit {trace.returncode}):\n{output[-3000:]}"
    assert trace.counts["loopback"] > 0, "nothing was traced: strace saw no loopback traffic at all"
    assert not trace.foreign, trace.report()


def test_one_toy_step_connects_only_to_loopback_and_leaves_home_alone(toy_dir, tmp_path):
    home = tmp_path / "home"  # Ray keeps a generated token in ~/.ray and reads a cluster config from ~
    home.mkdir()
    cmd = train_command(toy_dir, 0, tmp_path / "run", "algorithm.numSteps=1", "deployment.async=false")
    trace, output = run_traced(cmd, env={**_env(), "HOME": str(home)}, cwd=tmp_path, timeout=420)
    _assert_local(trace, output)
    assert '"event": "summary"' in output
    assert sorted(p.name for p in home.iterdir()) == [], "the trainer's Ray wrote into the user's HOME"
    print(trace.report())


def test_a_local_ray_head_and_its_job_connect_only_to_loopback(tmp_path):
    cmd = [sys.executable, str(REPO / "hack" / "localray.py"), "smoke"]
    trace, output = run_traced(cmd, env=_env(), cwd=tmp_path, timeout=300)
    _assert_local(trace, output)
    assert "Ray job: SUCCEEDED" in output
    print(trace.report())
