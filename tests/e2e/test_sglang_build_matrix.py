"""Every combination each SGLang build accepts trains the toy (a few steps) against the reference engine in that
build's strict mode, and every call the trainer made is one the build has (route and fields, checked against the
build's structs as its source spells them: tests/sglang_buildkit.py) and one the build's row of the table lists;
the combinations a build refuses are refused before anything starts.

`rollout.engine: hf` + `rollout.sglangBuild: NAME` starts the reference engine with `--sglang-build NAME`
(kora_engine/lm/strict.py): it stands in for the build's SGLang, which cannot run here (no GPU)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from kora_trainer.config import sglang_builds as sb
from kora_trainer.config.sections import DeploymentMode, SGLangBuild, SyncMode
from sglang_buildkit import MILES, STOCK, STOCK_0_5_17, call_problems, read_calls
from trainkit import TrainRun, train_command, wait_all

# CI runs one combination per route family (stock per-tensor Merge, stock in-memory Adapter, miles' adapter route);
# `make test-full` every one
CI_SIZE = {(STOCK, "Merge", "Disaggregated"), (STOCK, "Adapter", "Colocate"), (MILES, "Adapter", "Disaggregated")}
ACCEPTED = [(b, m, d) if (b, m, d) in CI_SIZE else pytest.param(b, m, d, marks=pytest.mark.full)
            for b in (STOCK, STOCK_0_5_17, MILES) for m in ("Merge", "Adapter") for d in ("Disaggregated", "Colocate")]


@pytest.mark.slow
@pytest.mark.parametrize(("build", "mode", "deployment"), ACCEPTED)
def test_the_toy_trains_on_the_strict_engine_of_each_build(toy_dir, tmp_path, build, mode, deployment):
    record = tmp_path / "calls.jsonl"
    run = TrainRun(toy_dir, tmp_path, f"lora.syncMode={mode}", f"deployment.mode={deployment}",
                   f"rollout.sglangBuild={build}", "algorithm.numSteps=2", env={"KORA_ENGINE_RECORD": str(record)})
    wait_all([run], poll=False)
    summary = run.summary()
    assert summary["steps"] == 2 and summary["sync_mode"] == mode and summary["sync_bytes_per_step"] > 0
    plan = sb.route_plan(sb.BUILDS[SGLangBuild(build)], SyncMode(mode), DeploymentMode(deployment), False)
    assert f"sync: {plan.note}" in run.log.read_text()  # the sync line says which route carried the policy
    calls = read_calls(record)
    assert call_problems(build, calls) == []
    used = {c["path"] for c in calls} - {"/generate", "/health", "/health_generate"}
    assert used and used <= set(plan.routes), f"routes outside the table's row: {used - set(plan.routes)}"
    assert "/generate" in {c["path"] for c in calls}
    assert [c for c in calls if c["status"] >= 400 and c["path"] != "/unload_lora_adapter"] == []


USE_MERGE, USE_MILES = "use lora.syncMode Merge", f"set rollout.sglangBuild to {MILES}"
REFUSED = [(STOCK, ["lora.syncMode=EngineMerge"], USE_MERGE),
           (MILES, ["lora.syncMode=EngineMerge", "deployment.mode=Colocate"], USE_MERGE),
           (STOCK, ["lora.syncMode=Adapter", "multiLora.maxAdapters=2", "deployment.mode=Disaggregated"], USE_MILES)]


@pytest.mark.parametrize(("build", "overrides", "fix"), REFUSED, ids=["stock-EngineMerge", "miles-EngineMerge",
                                                                      "stock-multi-LoRA"])
def test_combinations_a_build_refuses_stop_before_anything_starts(toy_dir, tmp_path, build, overrides, fix):
    record = tmp_path / "calls.jsonl"
    cmd = train_command(toy_dir, 0, tmp_path / "run", f"rollout.sglangBuild={build}", *overrides)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={
        **os.environ, "KORA_ENGINE_RECORD": str(record), "KORA_CONTROL_TOKEN": "t"}, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"sglang {build} does not have" in out.stderr and fix in out.stderr
    assert not record.exists()  # no engine ever answered a call
    assert not (tmp_path / "run" / "events.jsonl").exists()


def multi_lora_job(toy_dir: Path, work: Path, deployment: str) -> Path:
    """One adapter of 2 steps on the toy, multi-LoRA on the sglang-miles build's strict engine."""
    data = str(toy_dir / "train.parquet")
    reward = {"path": data, "rewardType": "custom", "customRewardPath": "toy_rewards.odd_first_digit"}
    job = {"model": {"path": str(toy_dir)}, "lora": {"rank": 8, "alpha": 16, "syncMode": "Adapter"},
           "algorithm": {"lr": 0.002, "rolloutBatchSize": 8, "nSamplesPerPrompt": 4, "globalBatchSize": 32,
                         "maxNewTokens": 4},
           "data": {"path": data, "inputKey": "prompt", "labelKey": "label"},
           "rollout": {"engine": "hf", "sglangBuild": MILES, "numEngines": 1, "gpusPerEngine": 0},
           "deployment": {"mode": deployment, "async": False}, "sync": {"bufferSize": "256Ki"},
           "multiLora": {"maxAdapters": 1, "adapters": [{"name": "odd", "rank": 8, "numSteps": 2, "data": reward}]}}
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    return work / "job.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("deployment", [pytest.param("Disaggregated", marks=pytest.mark.full), "Colocate"])
def test_multi_lora_trains_on_the_strict_engine_of_the_miles_build(toy_dir, tmp_path, deployment):
    record = tmp_path / "calls.jsonl"
    run = TrainRun(toy_dir, tmp_path, config=multi_lora_job(toy_dir, tmp_path, deployment),
                   env={"KORA_ENGINE_RECORD": str(record)})
    wait_all([run], poll=False)
    assert run.summary()["adapters"]["odd"]["steps"] == 2
    for e in run.events("adapter_step"):  # served as trained, at fp32 rounding (test_multi_lora.py's bound)
        assert e["rollout_logp_gap_max"] is not None and e["rollout_logp_gap_max"] <= 1e-4, e
    calls = read_calls(record)
    assert call_problems(MILES, calls) == []
    plan = sb.route_plan(sb.BUILDS[SGLangBuild.MILES_94949DA7], SyncMode.ADAPTER, DeploymentMode(deployment), True)
    used = {c["path"] for c in calls} - {"/generate", "/health", "/health_generate"}
    assert used <= set(plan.routes), f"routes outside the table's row: {used - set(plan.routes)}"
    rids = [r for c in calls if c["path"] == "/generate" for r in
            (c["body"]["rid"] if isinstance(c["body"]["rid"], list) else [c["body"]["rid"]])]
    assert rids and {r.split("::")[0] for r in rids} == {"odd"}  # the adapter's prefix, what a retire aborts


@pytest.mark.parametrize("build", [STOCK, MILES])
def test_the_trainer_refuses_at_start_an_sglang_that_is_not_the_build_named(toy_dir, tmp_path, build):
    """rollout.engine sglang: the installed SGLang must be the job's build (none is installed on this machine), said
    before Ray, an engine or the control plane starts."""
    cmd = train_command(toy_dir, 0, tmp_path / "run", "rollout.engine=sglang", "rollout.gpusPerEngine=1",
                        f"rollout.sglangBuild={build}", "lora.syncMode=Merge")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "KORA_CONTROL_TOKEN": "t"})
    assert out.returncode == 2, out.stderr[-2000:]
    want = sb.BUILDS[SGLangBuild(build)].pip_requirement
    assert f"rollout.sglangBuild: sglang is not installed: install {want}" in out.stderr
    assert f"--build-arg SGLANG_BUILD={build}" in out.stderr
    assert not (tmp_path / "run").exists()
