"""Every combination each SGLang build accepts trains the toy (a few steps) against the reference engine in that
build's strict mode, and every call the trainer made is one the build has (route and fields, checked against the
build's structs as its source spells them: tests/sglang_buildkit.py) and one the build's row of the table lists;
the combinations a build refuses are refused before anything starts.

`rollout.engine: hf` + `rollout.sglangBuild: NAME` starts the reference engine with `--sglang-build NAME`
(reference_engine/strict.py): it stands in for the build's SGLang, which cannot run here (no GPU)."""

from __future__ import annotations

import os
import subprocess

import pytest

from kora_trainer.config import sglang_builds as sb
from kora_trainer.config.sections import DeploymentMode, SGLangBuild, SyncMode
from sglang_buildkit import MILES, STOCK, call_problems, read_calls
from trainkit import TrainRun, train_command, wait_all

ACCEPTED = [(b, m, d) for b in (STOCK, MILES) for m in ("Merge", "Adapter") for d in ("Disaggregated", "Colocate")]


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
           (STOCK, ["lora.syncMode=Adapter", "multiLora.maxAdapters=2"], USE_MILES)]


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
