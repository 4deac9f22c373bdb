"""The SGLang build table (config/sglang_builds.py) and the refusals it drives: what `kora validate`, the CRD and the
trainer's start say for a combination the named build cannot do, and the check that the installed SGLang is it."""

from __future__ import annotations

import itertools

import pytest

from kora_trainer.config import TrainerConfig, spec_problems
from kora_trainer.config import sglang_builds as sb
from kora_trainer.config.sections import DeploymentMode, SGLangBuild, SyncMode
from kora_trainer.orchestration.sglang_launcher import sglang_build_problem
from sglang_buildkit import STRUCTS

MILES = SGLangBuild.MILES_94949DA7.value
ROWS = [(b, m, d, ml) for b, m, d, ml in itertools.product(sb.BUILDS.values(), SyncMode, DeploymentMode, (False, True))
        if not ml or m is SyncMode.ADAPTER]


def job(**rollout: object) -> dict:
    return {"model": {"path": "/m"}, "data": {"path": "/d.jsonl"}, "lora": {"rank": 8, "syncMode": "Adapter"},
            "rollout": rollout}


def errors(doc: dict) -> list:
    return [p for p in spec_problems(TrainerConfig.model_validate(doc)) if p.severity == "error"]


@pytest.mark.parametrize(("build", "mode", "deployment", "multi"), ROWS,
                         ids=[f"{b.name.value}-{m.value}-{d.value}-{'multi' if ml else 'single'}"
                              for b, m, d, ml in ROWS])
def test_every_row_uses_only_routes_the_build_has_or_is_refused_with_the_fix(build, mode, deployment, multi):
    plan = sb.route_plan(build, mode, deployment, multi)
    if plan.refused is not None:
        assert plan.routes == () and build.name.value in plan.refused
        assert ": " in plan.refused and ("set " in plan.refused or "use " in plan.refused)  # the fix
        return
    assert plan.routes and set(plan.routes) <= build.routes
    assert set(plan.routes) <= set(STRUCTS[build.name.value])  # and the build's source has each route's struct
    assert f"[sglang {build.name.value}]" in plan.note


def test_the_table_is_what_each_build_can_carry():
    stock, miles = sb.BUILDS[SGLangBuild.STOCK_0_5_23], sb.BUILDS[SGLangBuild.MILES_94949DA7]
    dis, colo = DeploymentMode.DISAGGREGATED, DeploymentMode.COLOCATE
    # the adapter over the weight-update group only where the build has the route; stock hands it over in memory
    assert sb.ADAPTER_OVER_GROUP in sb.route_plan(miles, SyncMode.ADAPTER, dis, False).routes
    stock_dis = sb.route_plan(stock, SyncMode.ADAPTER, dis, False)
    assert sb.ADAPTER_OVER_GROUP not in stock_dis.routes and "/load_lora_adapter_from_tensors" in stock_dis.routes
    assert "on the trainer's node" in stock_dis.note
    for b, d in itertools.product((stock, miles), (dis, colo)):
        assert sb.route_plan(b, SyncMode.ENGINE_MERGE, d, False).refused  # no SGLang build folds lora pairs
        assert sb.route_plan(b, SyncMode.MERGE, d, False).refused is None
    assert sb.route_plan(miles, SyncMode.ADAPTER, dis, True).refused is None


@pytest.mark.parametrize("build", [SGLangBuild.STOCK_0_5_17, SGLangBuild.STOCK_0_5_23])
def test_multi_lora_on_a_stock_build_runs_colocated_aborting_each_rid_and_is_refused_disaggregated(build):
    """A stock build has no AbortReq.prefix, no upsert and no adapter route over the group: Colocate publishes
    each adapter by unload + load in memory and a retire aborts each request by its exact rid (the rollout
    manager's registry); Disaggregated is refused naming the field and the fix."""
    b = sb.BUILDS[build]
    assert not b.abort_prefix and not b.adapter_over_group
    colo = sb.route_plan(b, SyncMode.ADAPTER, DeploymentMode.COLOCATE, True)
    assert colo.refused is None and "/abort_request" in colo.routes and "/unload_lora_adapter" in colo.routes
    assert "/load_lora_adapter_from_tensors" in colo.routes and sb.ADAPTER_OVER_GROUP not in colo.routes
    assert len(set(colo.routes)) == len(colo.routes) and "by its exact rid" in colo.note
    refused = sb.route_plan(b, SyncMode.ADAPTER, DeploymentMode.DISAGGREGATED, True).refused
    assert refused is not None and f"sglang {build.value} does not have" in refused
    for part in ("multiLora.maxAdapters", "deployment.mode Disaggregated", "set deployment.mode Colocate",
                 f"set rollout.sglangBuild to {MILES}"):
        assert part in refused, (part, refused)
    miles = sb.route_plan(sb.BUILDS[SGLangBuild.MILES_94949DA7], SyncMode.ADAPTER, DeploymentMode.COLOCATE, True)
    assert "exact rid" not in miles.note  # the prefix abort is the build's own


def test_engine_sglang_means_the_pinned_build_and_engine_hf_means_kora_unless_a_build_is_named():
    assert sb.effective_build(TrainerConfig.model_validate(job())).name is SGLangBuild.STOCK_0_5_23
    assert sb.effective_build(TrainerConfig.model_validate(job(engine="hf"))) is None
    assert sb.effective_build(TrainerConfig.model_validate(job(engine="hf", sglangBuild=MILES))).name.value == MILES


def test_refusals_at_the_door_name_the_build_and_the_fix():
    engine_merge = {**job(), "lora": {"rank": 8, "syncMode": "EngineMerge"}}
    (p,) = errors(engine_merge)
    assert (p.rule, p.field) == ("build-engine-merge", "lora.syncMode")
    assert "sglang 0.5.23 does not have" in p.message and "use lora.syncMode Merge" in p.message
    assert errors({**engine_merge, "rollout": {"engine": "hf"}}) == []  # kora's reference engine folds them
    (p,) = errors({**engine_merge, "rollout": {"engine": "hf", "sglangBuild": MILES}})  # its strict mode does not
    assert f"sglang {MILES} does not have" in p.message

    multi = {**job(), "multiLora": {"maxAdapters": 2}, "deployment": {"mode": "Disaggregated"}}
    (p,) = errors(multi)
    assert (p.rule, p.field) == ("build-multi-lora", "multiLora.maxAdapters")
    assert f"set rollout.sglangBuild to {MILES}" in p.message and "set deployment.mode Colocate" in p.message
    assert errors({**multi, "rollout": {"sglangBuild": MILES}}) == []
    for build in ("0.5.23", "0.5.17"):  # in memory, each rid aborted exactly
        assert errors({**multi, "deployment": {"mode": "Colocate"}, "rollout": {"sglangBuild": build}}) == []
    assert errors(job()) == [] and errors({**job(), "deployment": {"mode": "Colocate"}}) == []


def test_an_unknown_build_is_refused_naming_the_ones_kora_knows():
    with pytest.raises(Exception, match=r"0\.5\.23") as e:
        TrainerConfig.model_validate(job(sglangBuild="0.5.22"))
    assert MILES in str(e.value)


def test_the_trainer_checks_the_installed_sglang_is_the_build_named():
    stock, miles = sb.BUILDS[SGLangBuild.STOCK_0_5_23], sb.BUILDS[SGLangBuild.MILES_94949DA7]
    assert sglang_build_problem(stock, "0.5.23") is None
    wrong = sglang_build_problem(stock, "0.5.22")
    assert wrong is not None and "install sglang==0.5.23" in wrong and "SGLANG_BUILD=0.5.23" in wrong
    assert sglang_build_problem(miles, "0.5.19.dev1843+g94949da73.d20260722") is None  # setuptools-scm's spelling
    assert sglang_build_problem(miles, "0.5.23") is not None  # the stock release lacks the branch's routes
    assert sglang_build_problem(miles, "0.5.19.dev1+g12345678") is not None
    missing = sglang_build_problem(miles)  # not installed on this machine
    assert missing is not None and "sglang is not installed" in missing and sb.MILES_COMMIT in missing


def test_the_stock_build_hands_the_adapter_over_on_one_node_only():
    stock = sb.BUILDS[SGLangBuild.STOCK_0_5_23]
    plan = sb.route_plan(stock, SyncMode.ADAPTER, DeploymentMode.DISAGGREGATED, False)
    assert sb.same_node_problem(stock, plan, "node-a", ["node-a", "node-a"]) is None
    away = sb.same_node_problem(stock, plan, "node-a", ["node-a", "node-b"])
    assert away is not None and "node-b" in away and f"set rollout.sglangBuild to {MILES}" in away
    merge = sb.route_plan(stock, SyncMode.MERGE, DeploymentMode.DISAGGREGATED, False)
    assert sb.same_node_problem(stock, merge, "node-a", ["node-b"]) is None  # merged weights go over the group


def test_the_call_check_catches_kora_fields_and_missing_routes():
    """tests/sglang_buildkit.call_problems, which the strict-engine tests lean on, flags what kora's own route sends."""
    from sglang_buildkit import MILES as M
    from sglang_buildkit import STOCK, call_problems

    kora = {"method": "POST", "path": "/load_lora_adapter_from_distributed", "status": 200,
            "body": {"lora_name": "kora-policy", "config_dict": {}, "names": ["a"], "dtypes": ["float32"],
                     "shapes": [[1]], "group_name": "weight_update_group", "load_format": "flattened_bucket",
                     "bucket_index": 0, "num_buckets": 1, "weight_version": "1"}}
    (miles,) = call_problems(M, [kora])
    assert "['bucket_index', 'load_format', 'num_buckets', 'weight_version']" in miles
    (stock,) = call_problems(STOCK, [kora])
    assert "has no such route" in stock
    merge = {"method": "POST", "path": "/update_weights_from_tensor", "status": 200,
             "body": {"serialized_named_tensors": "<1 items>", "weight_update_mode": "lora_merge"}}
    assert call_problems(STOCK, [merge]) == [
        "/update_weights_from_tensor: fields sglang 0.5.23 does not have: ['weight_update_mode']"]
    assert call_problems(STOCK, [{**merge, "body": {"load_format": None}}]) == [
        "/update_weights_from_tensor: required fields missing: ['serialized_named_tensors']"]


def test_the_docs_table_is_the_code_table():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "sglang_builds.md").read_text()
    assert sb.table_markdown() in doc, "regenerate docs/sglang_builds.md's table from sglang_builds.table_markdown()"


def test_a_kuberay_job_whose_engines_land_on_another_worker_is_refused_on_the_stock_build():
    """No CEL can follow the placement: the operator's validation (ValidationFailed) and kora validate refuse it."""
    from kora_operator.validation import validate_job
    from specs import valid_job

    doc = valid_job(lora={"rank": 8, "syncMode": "Adapter"}, parallelism={"data": 4},
                    deployment={"mode": "Disaggregated"}, rollout={"numEngines": 1, "gpusPerEngine": 4},
                    resources={"workers": 2, "gpusPerWorker": 4})  # 4 ranks on worker-0, the engine on worker-1
    _, problems = validate_job(doc)
    (p,) = [p for p in problems if p.severity == "error"]
    assert (p.rule, p.field) == ("build-adapter-one-node", "rollout.sglangBuild")
    assert "engines run on worker-1" in p.message and f"set rollout.sglangBuild to {MILES}" in p.message
    doc["spec"]["rollout"]["sglangBuild"] = MILES  # the adapter goes over the weight-update group there
    assert [p for p in validate_job(doc)[1] if p.severity == "error"] == []
    doc["spec"]["rollout"].pop("sglangBuild")
    doc["spec"]["resources"] = {"workers": 1, "gpusPerWorker": 8}  # one worker: the in-memory hand-over works
    assert [p for p in validate_job(doc)[1] if p.severity == "error"] == []


@pytest.mark.parametrize(("build", "mode", "deployment", "needs"), [
    ("0.5.17", "Adapter", "Colocate", True),  # its /load_lora_adapter_from_tensors has no @auth_level
    ("0.5.17", "Merge", "Colocate", False),
    ("0.5.23", "Adapter", "Colocate", False),  # 0.5.23 marks the tensor LoRA route ADMIN_OPTIONAL
    (MILES, "Adapter", "Disaggregated", True),  # the adapter route over the group: no @auth_level at 94949da7
    (MILES, "Merge", "Disaggregated", False),
])
def test_engines_get_the_jobs_key_as_api_key_where_a_sync_route_would_be_open(build, mode, deployment, needs):
    doc = job(engine="sglang", sglangBuild=build)
    doc["lora"]["syncMode"], doc["deployment"] = mode, {"mode": deployment}
    assert sb.engines_need_api_key(TrainerConfig.model_validate(doc)) is needs
