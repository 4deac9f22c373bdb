"""Multi-LoRA on a stock SGLang build (issue 43 item 5): two adapters on one base against the reference engine in
SGLang 0.5.17's strict mode (kora_engine/lm/strict.py), Colocate: each publish is unload + load of the adapter's
name in memory (/load_lora_adapter_from_tensors; 0.5.17 has no upsert), each request carries `lora_path`, and a
retire aborts the adapter's requests by their exact rids from the rollout manager (0.5.17 has no abort by rid
prefix: its strict engine answers that form 400, which would fail the job).

One adapter is retired (DELETE) while its generation is in flight: the engine holds odd's second /generate until
its requests are aborted (kora_engine/faults.py's hold), so the retire lands mid-generate for certain. Its 32
requests are aborted, each by its own rid, none is left in flight, and the other adapter trains on to its numSteps,
served as trained; every call the trainer made is one 0.5.17 has (tests/sglang_buildkit.py)."""

from __future__ import annotations

import time

import pytest
from test_multi_lora import EVEN, GAP_MAX, api, job_file

from kora_engine.faults import HOLD_ADAPTER_ENV, HOLD_MARK
from kora_trainer.config import sglang_builds as sb
from kora_trainer.config.sections import DeploymentMode, SGLangBuild, SyncMode
from sglang_buildkit import STOCK_0_5_17, call_problems, read_calls
from trainkit import TrainRun, wait_all


def held_mark(run: TrainRun, timeout_s: float = 180.0) -> None:
    """Bounded: until the engine holds odd's second /generate."""
    log = run.run_dir / "logs" / "engine-0.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert run.running(), run.output[-3000:]
        if log.exists() and HOLD_MARK in log.read_text(errors="replace"):
            return
        time.sleep(0.1)
    pytest.fail(f"the engine never held odd's generation\n{run.output[-2000:]}")


def rids_of(call: dict) -> list[str]:
    rid = call["body"]["rid"]
    return rid if isinstance(rid, list) else [rid]


@pytest.mark.slow
@pytest.mark.full  # a Ray job of two adapters: ~80 s on a loaded 2-core machine
def test_an_adapter_retired_mid_generate_on_0_5_17_is_aborted_by_exact_rid_and_the_other_goes_on(toy_dir, tmp_path):
    data = str(toy_dir / "train.parquet")
    adapters = [{"name": "odd", "rank": 8, "numSteps": 50},
                {"name": "even", "rank": 8, "numSteps": 5, "seed": 7, "data": {**EVEN, "path": data}}]
    job = job_file(toy_dir, tmp_path, adapters, deployment={"mode": "Colocate", "async": False},
                   rollout={"sglangBuild": STOCK_0_5_17}, multiLora={"maxCoalesceWaitSeconds": 0.1})
    record = tmp_path / "calls.jsonl"
    run = TrainRun(toy_dir, tmp_path, config=job, env={"KORA_ENGINE_RECORD": str(record),
                                                        HOLD_ADAPTER_ENV: "odd:2"})
    try:
        held_mark(run)
        code, body = api(run, "DELETE", "/adapter_runs/odd")
        assert code == 202, body
        wait_all([run])
    finally:
        run.kill()
    summary = run.summary()["adapters"]
    assert summary["odd"]["phase"] == "Retired" and summary["odd"]["steps"] == 1, summary["odd"]
    assert summary["even"]["phase"] == "Succeeded" and summary["even"]["steps"] == 5, summary["even"]
    events = run.events()
    (retired,) = [e for e in events if e.get("event") == "adapter_retired" and e["adapter"] == "odd"]
    assert retired["aborted"]["aborted"] == 32 and set(retired["aborted"]["in_flight_left"].values()) == {0}, retired
    later = [e for e in events[events.index(retired):] if e.get("event") == "adapter_step"]
    assert later and {e["adapter"] for e in later} == {"even"}  # the other adapter went on
    for e in run.events("adapter_step"):  # each served as trained (its own adapter, its own version)
        assert e["rollout_logp_gap_max"] is not None and e["rollout_logp_gap_max"] <= GAP_MAX, e
    calls = read_calls(record)
    assert call_problems(STOCK_0_5_17, calls) == []
    plan = sb.route_plan(sb.BUILDS[SGLangBuild.STOCK_0_5_17], SyncMode.ADAPTER, DeploymentMode.COLOCATE, True)
    used = {c["path"] for c in calls} - {"/generate", "/health", "/health_generate"}
    assert used <= set(plan.routes), f"routes outside the table's row: {used - set(plan.routes)}"
    aborts = [c for c in calls if c["path"] == "/abort_request"]
    assert aborts and all(c["status"] == 200 and set(c["body"]) == {"rid"} for c in aborts), aborts[:3]
    held = [c for c in calls if c["path"] == "/generate" and c["body"].get("lora_path") == "odd"][-1]
    assert {c["body"]["rid"] for c in aborts} == set(rids_of(held))  # exactly the held call's requests
    assert [c for c in calls if c["status"] >= 400 and c["path"] != "/unload_lora_adapter"] == []
