"""The multi-adapter API on the control plane (`/adapter_runs`): a real HTTP server on 127.0.0.1 over the real
registry; what the operator's LoRAAdapter handler (through its client, kora_operator.adapter_runs) and a user with
curl see."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from kora_operator.adapter_runs import AdapterRuns, Refused
from kora_operator.progress import ProgressUnavailable
from kora_trainer.adapter_runs.api import AdapterRunsAPI
from kora_trainer.adapter_runs.registry import AdapterRegistry
from kora_trainer.config.adapter_runs import AdapterPhase, AdapterRunState
from kora_trainer.config.sections import AdapterRunConfig
from kora_trainer.control_plane import ControlPlane, Progress
from localcluster import free_ports
from specs import multi_adapter_registry

TOKEN = "s3cret"


def call(url: str, method: str = "GET", body: object | None = None, token: str | None = TOKEN) -> tuple[int, object]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def job(tmp_path):
    registry, data = multi_adapter_registry(tmp_path)
    cp = ControlPlane(Progress(0, "Adapter"), TOKEN, port=0, host="127.0.0.1", routes=AdapterRunsAPI(registry)).start()
    yield cp.url, registry, str(data)
    cp.stop()


def adapter(data: str, **over: object) -> dict[str, object]:
    return {"rank": 8, "data": {"path": data}, "numSteps": 3, **over}


def test_register_list_state_and_the_slots_fill(job):
    url, registry, data = job
    assert call(f"{url}/adapter_runs", "POST", {"name": "a", "config": adapter(data)}, token=None)[0] == 401
    code, a = call(f"{url}/adapter_runs", "POST", {"name": "a", "config": adapter(data)})
    assert code == 201 and a["phase"] == "Pending" and a["slot"] == 0 and a["numSteps"] == 3
    code, b = call(f"{url}/adapter_runs", "POST", {"name": "b", "config": adapter(data, rank=16)})
    assert code == 201 and b["slot"] == 1
    code, full = call(f"{url}/adapter_runs", "POST", {"name": "c", "config": adapter(data)})
    assert code == 409 and "no free slot" in full["error"] and "multiLora.maxAdapters" in full["error"]
    code, again = call(f"{url}/adapter_runs", "POST", {"name": "a", "config": adapter(data)})
    assert code == 409 and "already registered" in again["error"]
    code, listing = call(f"{url}/adapter_runs")
    assert code == 200 and [x["name"] for x in listing["adapters"]] == ["a", "b"]
    assert listing["adapters"][1]["config"]["rank"] == 16
    code, state = call(f"{url}/adapter_runs/state")
    assert code == 200 and state["maxAdapters"] == 2 and state["active"] == 2
    assert call(f"{url}/adapter_runs/b")[1]["slot"] == 1
    assert call(f"{url}/adapter_runs/nope")[0] == 404
    # the driver's view: both are to be loaded, in registration order
    assert [s.name for s in registry.to_load()] == ["a", "b"]
    assert registry.to_load()[0].global_batch_size == 16  # the job's rolloutBatchSize x nSamplesPerPrompt


def test_bad_configs_are_400_with_the_field_and_the_fix(job):
    url, _, data = job
    cases = [
        ({"name": "a", "config": adapter(data, rank=32)}, "exceeds the job's lora.rank 16"),
        ({"name": "a", "config": adapter(data, nSamplesPerPrompt=3)}, "nSamplesPerPrompt 3 must divide"),
        ({"name": "a", "config": adapter(data, rolloutBatchSize=1, nSamplesPerPrompt=1)},
         "rolloutBatchSize 1 must be a multiple of 2"),
        ({"name": "a", "config": adapter(data, rolloutBatchSize=64)}, "exceeds the job's cap 64"),
        ({"name": "a", "config": adapter("/nowhere.jsonl")}, "data.path /nowhere.jsonl is not a file"),
        ({"name": "a", "config": {**adapter(data), "data": {**adapter(data)["data"], "imageKey": "image"}}},
         "data.imageKey image: the job's model"),
        ({"name": "a", "config": adapter(data, numEpochs=2)}, "numSteps and numEpochs are both set"),
        ({"name": "Bad_Name", "config": adapter(data)}, "name: String should match pattern"),
        ({"name": "kora-policy", "config": adapter(data)}, "pick another name"),
        ({"name": "a", "config": {**adapter(data), "rnak": 4}}, "config.rnak: Extra inputs are not permitted"),
        ({"name": "a"}, "config: Field required"),
    ]
    for body, words in cases:
        code, answer = call(f"{url}/adapter_runs", "POST", body)
        assert code == 400 and words in answer["error"], (body, answer)
    code, answer = call(f"{url}/adapter_runs", "POST", b"{not json")
    assert code == 400 and "not JSON" in answer["error"]
    assert call(f"{url}/adapter_runs/state")[1]["active"] == 0  # nothing was half-registered


@pytest.mark.parametrize(("field", "value"), [
    ("numSteps", 2**64), ("numEpochs", 10**7), ("rolloutBatchSize", 10**12), ("nSamplesPerPrompt", 10**6),
    ("rank", 10**6), ("seed", 2**64), ("seed", -1),
])
def test_an_adapters_integers_past_their_bounds_are_400_naming_the_field(job, field, value):
    """The bounds the job's own integers have (config/sections.py), so that numSteps 2**64 is refused with its name
    rather than registered (a step count no loop reaches, a batch no memory holds, a seed torch cannot take)."""
    url, _, data = job
    code, answer = call(f"{url}/adapter_runs", "POST", {"name": "a", "config": adapter(data, **{field: value})})
    assert code == 400 and f"config.{field}" in answer["error"], answer
    assert call(f"{url}/adapter_runs/state")[1]["active"] == 0


def test_delete_retires_then_forgets_and_the_slot_is_reused(job):
    url, registry, data = job
    call(f"{url}/adapter_runs", "POST", {"name": "a", "config": adapter(data)})
    call(f"{url}/adapter_runs", "POST", {"name": "b", "config": adapter(data)})
    registry.loaded("a", num_steps=3)
    code, retiring = call(f"{url}/adapter_runs/a", "DELETE")
    assert code == 202 and retiring["phase"] == "Retiring" and retiring["slot"] == 0
    assert registry.to_retire() == [("a", AdapterPhase.RETIRED)]
    assert call(f"{url}/adapter_runs", "POST", {"name": "c", "config": adapter(data)})[0] == 409  # a still holds it
    registry.finished("a", AdapterPhase.RETIRED, "deleted", export_path="/x")
    code, c = call(f"{url}/adapter_runs", "POST", {"name": "c", "config": adapter(data)})
    assert code == 201 and c["slot"] == 0  # a's slot, taken by the next registration
    assert call(f"{url}/adapter_runs/a")[1]["phase"] == "Retired"  # the record stays until forgotten
    assert call(f"{url}/adapter_runs/a", "DELETE")[0] == 200
    assert call(f"{url}/adapter_runs/a")[0] == 404
    # b never trained: DELETE retires it at once
    code, b = call(f"{url}/adapter_runs/b", "DELETE")
    assert code == 202 and b["phase"] == "Retired" and b["slot"] is None


def test_an_adapter_succeeds_at_its_num_steps(job):
    url, registry, data = job
    call(f"{url}/adapter_runs", "POST", {"name": "a", "config": adapter(data)})
    registry.loaded("a", num_steps=3)
    registry.stepped("a", 2, 0.5)
    assert registry.to_retire() == []
    registry.stepped("a", 3, 0.75)
    assert registry.to_retire() == [("a", AdapterPhase.SUCCEEDED)]
    state = call(f"{url}/adapter_runs/a")[1]
    assert state["step"] == 3 and state["rewardMean"] == 0.75 and state["phase"] == "Training"


def test_registrations_survive_a_restart(job, tmp_path):
    url, registry, data = job
    call(f"{url}/adapter_runs", "POST", {"name": "a", "config": adapter(data)})
    call(f"{url}/adapter_runs", "POST", {"name": "b", "config": adapter(data, rank=4)})
    call(f"{url}/adapter_runs/a", "DELETE")  # never trained: retired at once, not brought back
    again = AdapterRegistry(registry.cfg, registry.state_file)
    assert again.restore() == ["b"]
    restored = again.to_load()
    assert [(s.name, s.slot, s.rank) for s in restored] == [("b", 1, 4)]


def test_unknown_methods_and_paths(job):
    url, _, _ = job
    assert call(f"{url}/adapter_runs/state", "DELETE")[0] == 405
    assert call(f"{url}/adapter_runs/a/b")[0] == 404
    assert call(f"{url}/other", "POST", {})[0] == 404


def test_the_trainer_refuses_a_given_adapter_the_registry_would_refuse(tmp_path, capsys):
    from kora_trainer.train import main

    job = tmp_path / "job.yaml"
    (tmp_path / "x.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')  # the job's own data is there
    job.write_text(json.dumps({
        "model": {"path": str(tmp_path)}, "lora": {"rank": 16, "syncMode": "Adapter"},
        "data": {"path": str(tmp_path / "x.jsonl")}, "rollout": {"engine": "hf"},
        "multiLora": {"maxAdapters": 2, "adapters": [{"name": "a", "rank": 8, "data": {"path": "/nowhere.jsonl"}}]}}))
    assert main(["--config", str(job), "--run-dir", str(tmp_path / "run"), "--control-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "multiLora.adapters: data.path /nowhere.jsonl is not a file" in err


# -- the operator's side: its client of these routes (kora_operator.adapter_runs) ----------------------------------


def test_the_operators_client_registers_reads_and_deregisters(job):
    url, registry, data = job
    client = AdapterRuns(url, TOKEN, timeout=5)
    got = client.register("a", AdapterRunConfig.model_validate(adapter(data)))
    assert isinstance(got, AdapterRunState) and got.phase is AdapterPhase.PENDING and got.slot == 0
    assert not isinstance(client.register("b", AdapterRunConfig.model_validate(adapter(data))), Refused)
    full = client.register("c", AdapterRunConfig.model_validate(adapter(data)))
    assert isinstance(full, Refused) and full.no_free_slot and "multiLora.maxAdapters" in full.message
    taken = client.register("a", AdapterRunConfig.model_validate(adapter(data)))
    assert isinstance(taken, Refused) and taken.code == 409 and not taken.no_free_slot
    bad = client.register("d", AdapterRunConfig.model_validate(adapter(data, rank=32)))
    assert isinstance(bad, Refused) and bad.code == 400 and "exceeds the job's lora.rank 16" in bad.message
    state = client.state()
    assert (state.max_adapters, state.active, [a.name for a in state.adapters]) == (2, 2, ["a", "b"])
    registry.loaded("a", num_steps=3)
    assert client.delete("a") == 202 and client.get("a").phase is AdapterPhase.RETIRING
    registry.finished("a", AdapterPhase.RETIRED, "deleted")
    assert client.delete("a") == 200 and client.get("a") is None and client.delete("a") == 404


def test_the_operators_client_says_why_it_cannot_ask(job):
    url, _, _ = job
    with pytest.raises(ProgressUnavailable, match="refused the job's control-plane token") as e:
        AdapterRuns(url, "not-the-token", timeout=5).state()
    assert e.value.unauthorized
    with pytest.raises(ProgressUnavailable, match="cannot read"):
        AdapterRuns(f"http://127.0.0.1:{free_ports(1)[0]}", TOKEN, timeout=5).state()
