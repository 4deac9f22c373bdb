"""runtimes/: the one choice of a job's runtime, and what each runtime answers without I/O."""

from __future__ import annotations

from typing import Any

import pytest

from kora_operator.api.status import Phase
from kora_operator.runtimes import KUBERAY, RAY, runtime_of
from kora_operator.settings import Settings


@pytest.mark.parametrize(("spec", "want"), [
    ({}, KUBERAY),
    ({"runtime": None}, KUBERAY),
    ({"runtime": {"kind": "KubeRay"}}, KUBERAY),
    ({"runtime": {"kind": "Ray", "address": "http://127.0.0.1:8265"}}, RAY),
])
def test_the_spec_chooses_the_runtime_once(spec: dict[str, Any], want: object) -> None:
    assert runtime_of(spec) is want


def test_only_ray_keeps_a_deleted_job_until_its_trainer_stopped() -> None:
    assert RAY.stops_on_delete and not KUBERAY.stops_on_delete


@pytest.mark.parametrize("phase", [None, Phase.PENDING, Phase.PROVISIONING, Phase.RUNNING, Phase.SUSPENDED])
def test_a_ray_job_is_polled_until_it_ends_a_kuberay_one_only_for_its_running_trainer(phase: Phase | None) -> None:
    reach, blind = Settings(kuberay_progress=True), Settings(kuberay_progress=False)
    assert RAY.polls(phase, reach) and RAY.polls(phase, blind)
    assert KUBERAY.polls(phase, reach) is (phase == Phase.RUNNING)
    assert not KUBERAY.polls(phase, blind)


def test_a_kuberay_trainer_is_reached_at_its_head_service_only_when_the_operator_may() -> None:
    class Ops:
        def __init__(self, reach: bool) -> None:
            self.settings = Settings(kuberay_progress=reach)

    body = {"metadata": {"namespace": "ns"}, "status": {"phase": "Running", "rayClusterName": "c"}}
    assert KUBERAY.trainer_url(Ops(True), body) == "http://c-head-svc.ns.svc:8068"  # type: ignore[arg-type]
    assert KUBERAY.trainer_url(Ops(False), body) is None  # type: ignore[arg-type]
