"""The reference engine in each SGLang build's strict mode (`--sglang-build NAME`, kora_engine/lm/strict.py), and
the trainer's sender against it: the routes the build lacks are FastAPI's 404, kora's fields are ignored as SGLang
ignores unknown keys, and every request body the sender makes in each mode and transport is one of the build's
structs (recorded as the engine received it, checked against tests/sglang_buildkit.py's copies of the sources),
while the engine still ends up serving exactly the trained policy.

The reference engine stands in for SGLang, which cannot run here (no GPU); what it stands in for is the build's
HTTP contract, cited per struct in sglang_buildkit.py."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request

import pytest

from engine_helpers import (
    ATOL,
    PROMPTS,
    logprob_gap,
    make_peft_adapter,
    peft_config_dict,
    peft_tensors,
    start_engine,
    stop_engine,
    trained_policy,
)
from kora_engine.faults import HOLD_ADAPTER_ENV, HOLD_MARK
from kora_trainer.config import sglang_builds as sb
from kora_trainer.config.sections import DeploymentMode, SGLangBuild, SyncMode
from kora_trainer.sync.sender import POLICY_ADAPTER, WeightSender
from kora_trainer.sync.transport import ColocatedTransport, DistributedTransport, SyncError
from kora_trainer.wire.engine_client import EngineError
from kora_trainer.wire.serialize import serialize_named_tensors, serialize_tensor_dict
from localcluster import wait_for
from sglang_buildkit import MILES, STOCK, STOCK_0_5_17, call_problems, read_calls
from tinymodel import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=[STOCK, STOCK_0_5_17, MILES])
def strict(request, model_dir, tmp_path_factory):
    """(build name, engine, its call record) for one strict engine per build."""
    logs = tmp_path_factory.mktemp(f"strict-{request.param}")
    record = logs / "calls.jsonl"
    # the adapter named `held` waits in /generate until aborted (faults.py): the abort test's request in flight
    proc = start_engine(model_dir, logs, "--max-lora-rank", "8", "--sglang-build", request.param,
                        env={"KORA_ENGINE_RECORD": str(record), HOLD_ADAPTER_ENV: "held:1"})
    yield request.param, proc, record
    stop_engine(proc)


def post(url: str, body: object) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_routes_the_build_lacks_are_404_as_in_that_build(strict):
    build, engine, _ = strict
    for path in ("/kora/fast_sync/plan", "/kora/colocated/plan"):
        assert post(engine.url + path, {}) == (404, {"detail": "Not Found"})
    assert get(engine.url + "/kora/state") == (404, {"detail": "Not Found"})
    status, info = get(engine.url + "/model_info")
    assert status == 200 and "kora_engine" not in info and "weight_version" in info  # SGLang's keys only
    status, body = post(engine.url + "/load_lora_adapter_from_distributed", {"lora_name": "x"})
    if build != MILES:
        assert (status, body) == (404, {"detail": "Not Found"})
    else:  # sglang-miles has it: a body without its required fields is FastAPI's 400
        assert status == 400 and "LoadLoRAAdapterFromDistributedReqInput" in body["message"]


def test_the_lora_route_takes_sglangs_dict_and_refuses_a_list_of_pairs(strict, model_dir, tmp_path):
    """SGLang's LoRA manager iterates the payload's items (0.5.17's tp_worker; a list was a 400 "'list' object has no
    attribute 'items'" on a real SGLang, issue 43): a build's strict engine refuses the list the same way, so the CPU
    tests catch a sender that sends it."""

    _, engine, _ = strict
    _, peft_model = make_peft_adapter(model_dir, tmp_path / "adapter", seed=3)
    named = peft_tensors(peft_model)
    body = {"lora_name": "pairs", "config_dict": peft_config_dict(peft_model)}
    status, answer = post(engine.url + "/load_lora_adapter_from_tensors",
                          {**body, "serialized_named_tensors": [serialize_named_tensors(named)]})
    assert status == 400 and "dict {name: tensor}" in json.dumps(answer)
    status, answer = post(engine.url + "/load_lora_adapter_from_tensors",
                          {**body, "serialized_named_tensors": [serialize_tensor_dict(named)]})
    assert status == 200 and answer["success"], answer


CASES = [("Merge", "distributed"), ("Merge", "colocated"), ("Adapter", "distributed"), ("Adapter", "colocated")]


@pytest.mark.parametrize(("mode", "transport"), CASES)
def test_the_sender_speaks_only_the_build_and_the_engine_serves_the_policy(strict, model_dir, mode, transport):
    build, engine, record = strict
    b = trained_policy(model_dir, mode, seed=len(mode) + len(transport), cap=24 * 1024)
    b.cfg = b.cfg.model_copy(update={"rollout": b.cfg.rollout.model_copy(update={"sglang_build": SGLangBuild(build)})})
    lora_path = POLICY_ADAPTER if mode == "Adapter" else None
    with engine.client() as client, contextlib.suppress(EngineError):
        client.unload_lora_adapter(POLICY_ADAPTER)  # a fresh engine's state: an earlier case may have left it loaded
    record.write_text("")
    with engine.client() as client:
        t = DistributedTransport.connect([client], backend="gloo") if transport == "distributed" \
            else ColocatedTransport([client])
        sender = WeightSender(b.model, b.cfg, t)
        try:
            first = sender.sync(version=1)
            assert first.pushed and first.note.endswith(f"[sglang {build}]")
            assert logprob_gap(client, b, lora_path) < ATOL
            if mode == "Adapter":  # a second push replaces the adapter under its one name
                import torch

                with torch.no_grad():
                    for p in b.params:
                        p.add_(0.05)
                assert sender.sync(version=2).what == "adapter"
                assert logprob_gap(client, b, lora_path) < ATOL
            assert client.generate(PROMPTS[:1], {"max_new_tokens": 1}, lora_path=lora_path)[0].weight_version \
                == ("2" if mode == "Adapter" else "1")
        finally:
            sender.close()
    calls = read_calls(record)
    assert call_problems(build, calls) == []
    deployment = DeploymentMode.COLOCATE if transport == "colocated" else DeploymentMode.DISAGGREGATED
    plan = sb.route_plan(sb.BUILDS[SGLangBuild(build)], SyncMode(mode), deployment, False)
    used = {c["path"] for c in calls} - {"/generate", "/health"}
    assert used <= set(plan.routes), f"routes outside the table's row: {used - set(plan.routes)}"
    # in memory, each call is one flattened bucket where the build reads that (one CUDA IPC handle, not one per
    # tensor: 0.5.17), else the tensors one by one
    in_memory = [c["body"].get("load_format") for c in calls
                 if c["path"] in ("/update_weights_from_tensor", "/load_lora_adapter_from_tensors")]
    assert in_memory or transport == "distributed"
    assert set(in_memory) <= {"flattened_bucket" if sb.BUILDS[SGLangBuild(build)].flat_in_memory else None}
    # every call answered 200: the first in-memory push only loads (an unload of a name the engine never had is a 400
    # in SGLang's access log: the first real-SGLang Adapter run showed it, issue 43)
    assert all(c["status"] == 200 for c in calls), [c for c in calls if c["status"] != 200]


def test_a_restarted_trainer_replaces_the_adapter_the_engine_still_holds(strict, model_dir):
    """A new trainer's first in-memory push of a name the engine still serves (from the trainer before a restart):
    SGLang refuses the load ("already"), so the sender unloads and loads it, and the engine serves the new one."""
    build, engine, _ = strict
    b = trained_policy(model_dir, "Adapter", seed=7, cap=24 * 1024)
    b.cfg = b.cfg.model_copy(update={"rollout": b.cfg.rollout.model_copy(update={"sglang_build": SGLangBuild(build)})})
    with engine.client() as client:
        for _ in range(2):  # the trainer before the restart, then the restarted one (a fresh sender)
            sender = WeightSender(b.model, b.cfg, ColocatedTransport([client]))
            try:
                assert sender.sync(version=1).pushed
            finally:
                sender.close()
        assert logprob_gap(client, b, POLICY_ADAPTER) < ATOL


def test_kora_fields_are_ignored_as_sglang_ignores_unknown_keys(strict, model_dir):
    """EngineMerge's lora_merge fields are kora's: a build's engine takes the lora_A/lora_B pairs for weights
    and fails the push, as SGLang would (which is why the build refuses EngineMerge at the door)."""
    _, engine, _ = strict
    b = trained_policy(model_dir, "EngineMerge", seed=3, cap=24 * 1024)
    with engine.client() as client:
        sender = WeightSender(b.model, b.cfg, ColocatedTransport([client]))  # b.cfg: engine hf, kora's fields sent
        with pytest.raises(SyncError, match="1 of 1 engines failed"):
            sender.sync(version=1)


def test_the_miles_adapter_route_refuses_a_loaded_name_without_upsert(strict, model_dir):
    build, engine, _ = strict
    if build != MILES:
        pytest.skip("sglang-miles' route (the stock build has none: the 404 test above)")
    b = trained_policy(model_dir, "Adapter", seed=9, cap=24 * 1024)
    from kora_trainer.sync.sources import adapter_source

    src = adapter_source(b.model)
    named = list(src.get(src.names).items())
    with engine.client() as client:
        t = DistributedTransport.connect([client], backend="gloo")
        try:
            config = WeightSender(b.model, b.cfg, None).adapter_config
            for upsert in (True, True):  # a fresh load, then an in-place refresh
                t.send_tensors(named, lambda c, meta, u=upsert: c.load_lora_adapter_over_group("a", config, meta,
                                                                                              upsert=u))
            with pytest.raises(SyncError) as e:
                t.send_tensors(named, lambda c, meta: c.load_lora_adapter_over_group("a", config, meta, upsert=False))
            assert isinstance(e.value.__cause__, EngineError)
            assert "Failed to load LoRA adapter a because it is already loaded" in e.value.__cause__.message
        finally:
            t.close()


def test_a_build_without_prefix_abort_refuses_it_and_aborts_each_rid_exactly(strict, model_dir, tmp_path):
    """A stock build's AbortReq has no `prefix` (0.5.17 IO:1906; the real build ignores the key and aborts nothing):
    its strict engine answers the prefix form 400 naming the build, while the exact-rid abort (what the rollout
    manager sends on a retire) ends the request in flight, aborted, as on every build. sglang-miles takes both."""
    build, engine, _ = strict
    _, peft_model = make_peft_adapter(model_dir, tmp_path / "adapter", seed=5)
    body = {"lora_name": "held", "config_dict": peft_config_dict(peft_model),
            "serialized_named_tensors": [serialize_tensor_dict(peft_tensors(peft_model))]}
    assert post(engine.url + "/load_lora_adapter_from_tensors", body)[0] == 200
    marks = engine.log.read_text().count(HOLD_MARK)
    rids = ["held::a", "held::b"]
    with engine.client() as client:
        try:
            fut = client.submit(client.generate, PROMPTS[:2], {"max_new_tokens": 4}, lora_path="held", rid=rids)
            wait_for(lambda: engine.log.read_text().count(HOLD_MARK) > marks, timeout=30.0, interval=0.05,
                     what="the held /generate admitted")
            status, answer = post(engine.url + "/abort_request", {"rid": "held::", "prefix": True})
            if build == MILES:
                assert status == 200
            else:
                assert status == 400 and f"sglang {build} has no AbortReq.prefix" in answer["error"]["message"]
                assert not fut.done()  # nothing was aborted
                for rid in rids:
                    assert post(engine.url + "/abort_request", {"rid": rid}) == (200, None)
            outs = fut.result(timeout=30)
        finally:
            client.unload_lora_adapter("held")
    assert [o.finish_reason["type"] for o in outs] == ["abort", "abort"] and all(not o.output_ids for o in outs)


def test_0_5_17s_lora_route_is_open_with_an_admin_key_alone_and_kora_closes_it_with_an_api_key(model_dir, tmp_path):
    """0.5.17 serves /load_lora_adapter_from_tensors without @auth_level (a NORMAL route), so an engine with only an
    admin key loads any caller's pickles there; kora gives such engines the job's key as their api key too
    (sglang_builds.engines_need_api_key), which closes it. The strict engine of the build shows both."""
    _, peft_model = make_peft_adapter(model_dir, tmp_path / "adapter", seed=4)
    body = {"lora_name": "x", "config_dict": peft_config_dict(peft_model),
            "serialized_named_tensors": [serialize_tensor_dict(peft_tensors(peft_model))]}
    for keys, status in (({"KORA_ENGINE_ADMIN_API_KEY": "k"}, 200),
                         ({"KORA_ENGINE_ADMIN_API_KEY": "k", "KORA_ENGINE_API_KEY": "k"}, 401)):
        proc = start_engine(model_dir, tmp_path, "--max-lora-rank", "8", "--sglang-build", STOCK_0_5_17, env=keys)
        try:
            got, _ = post(proc.url + "/load_lora_adapter_from_tensors", body)  # no key sent
            assert got == status, (keys, got)
        finally:
            stop_engine(proc)
