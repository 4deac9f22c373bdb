"""Engine keys, SGLang's rules (wire/engine_auth.py): the reference engine as a real process started the way
the trainer starts it (EngineProcess, keys by environment), raw HTTP against it, and the trainer's client.

- admin key only: every admin route is 401 without a key and with a wrong one, and served with the key;
  /health* stay open, /generate and /model_info need no key;
- admin and api key: /generate needs the api key (the admin key does not open it), admin routes need the
  admin key (the api key does not open them); `x-api-key` and a lower-case `bearer` count;
- the client sends each key where it belongs; the keys never appear in the engine's argv.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from kora_trainer.config import load_config
from kora_trainer.orchestration.engines import EngineProcess
from kora_trainer.wire import engine_auth
from kora_trainer.wire.engine_auth import ADMIN_ROUTES, Level, allowed, new_admin_key, route_level
from kora_trainer.wire.engine_client import EngineClient, EngineError
from tinymodel import make_tiny_model

pytestmark = pytest.mark.timeout(180)
ADMIN, API = new_admin_key(), new_admin_key()
KORA_ROUTES = ["/kora/state", "/kora/fast_sync/plan", "/kora/fast_sync/push"]
# every admin route the reference engine serves, and the bodies some of them answer 200 to
ADMIN_CALLS = [("GET" if p == "/kora/state" else "POST", p) for p in sorted(ADMIN_ROUTES) + KORA_ROUTES]
CHEAP_200 = {"/flush_cache": None, "/pause_generation": {"mode": "in_place"}, "/continue_generation": {},
             "/update_weight_version": {"new_version": "v-auth"}, "/kora/state": None}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def engine_config(model_dir: Path):
    cfg, _ = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "lora.rank=4",
                                "rollout.engine=hf", "rollout.gpusPerEngine=0"])
    return cfg


@pytest.fixture(scope="module")
def admin_only(model_dir, tmp_path_factory):
    engine = EngineProcess.start(engine_config(model_dir), tmp_path_factory.mktemp("logs"), threads=1,
                                 admin_api_key=ADMIN, timeout_s=120)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def both_keys(model_dir, tmp_path_factory):
    engine = EngineProcess.start(engine_config(model_dir), tmp_path_factory.mktemp("logs"), threads=1, index=1,
                                 admin_api_key=ADMIN, api_key=API, timeout_s=120)
    yield engine
    engine.stop()


def call(engine: EngineProcess, method: str, path: str, key: str | None = None, body: object = None,
         **headers: str) -> requests.Response:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return requests.request(method, engine.url + path, json={} if body is None else body, headers=headers, timeout=60)


GENERATE = {"input_ids": [[1, 4, 5]], "sampling_params": {"max_new_tokens": 1}}


@pytest.mark.parametrize(("method", "path"), ADMIN_CALLS, ids=[p for _, p in ADMIN_CALLS])
def test_every_admin_route_needs_the_admin_key(admin_only, method, path):
    for key in (None, "wrong-" + ADMIN):
        r = call(admin_only, method, path, key)
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"}), (path, key)
    try:
        r = call(admin_only, method, path, ADMIN, CHEAP_200.get(path))
    finally:
        if path == "/pause_generation":  # the later tests generate
            assert call(admin_only, "POST", "/continue_generation", ADMIN).status_code == 200
    assert r.status_code not in (401, 404), (path, r.status_code, r.text)  # served: past the auth, a route here
    if path in CHEAP_200:
        assert r.status_code == 200, (path, r.text)


def test_probes_and_normal_routes_are_open_with_only_an_admin_key(admin_only):
    for path in ("/health", "/health_generate"):
        assert requests.get(admin_only.url + path, timeout=60).status_code == 200
        assert requests.get(admin_only.url + path, headers={"Authorization": "Bearer nope"},
                            timeout=60).status_code == 200
    assert call(admin_only, "POST", "/generate", body=GENERATE).status_code == 200
    assert requests.get(admin_only.url + "/model_info", timeout=60).status_code == 200
    assert requests.options(admin_only.url + "/update_weight_version", timeout=60).status_code != 401


def test_with_an_api_key_too_each_key_opens_only_its_own_routes(both_keys):
    assert call(both_keys, "POST", "/generate", body=GENERATE).status_code == 401
    assert call(both_keys, "POST", "/generate", ADMIN, GENERATE).status_code == 401  # SGLang: api key only
    assert call(both_keys, "POST", "/generate", API, GENERATE).status_code == 200
    assert call(both_keys, "POST", "/generate", body=GENERATE, **{"x-api-key": API}).status_code == 200
    assert call(both_keys, "POST", "/generate", body=GENERATE, Authorization=f"bearer {API}").status_code == 200
    assert call(both_keys, "POST", "/nowhere", body={}).status_code == 401  # an unknown path is a NORMAL route
    version = {"new_version": "v-both"}
    assert call(both_keys, "POST", "/update_weight_version", API, version).status_code == 401  # admin key only
    assert call(both_keys, "POST", "/update_weight_version", ADMIN, version).status_code == 200
    assert requests.get(both_keys.url + "/health", timeout=60).status_code == 200


def test_the_client_sends_each_key_where_it_belongs(both_keys):
    with EngineClient(both_keys.url, api_key=API, admin_api_key=ADMIN, timeout=60) as client:
        assert client.health() and client.model_info()["kora_engine"] == "hf"
        assert client.generate([[1, 4, 5]], {"max_new_tokens": 2})[0].output_ids
        assert client.update_weight_version("v-client")["success"]
        assert client.pause_generation("in_place")["status"] == "ok"
        assert client.request("GET", "/kora/state")["held_requests"] == 0
        assert client.continue_generation()["status"] == "ok"
        assert "Cache flushed" in client.flush_cache()
        assert client.generate([[1, 4]], {"max_new_tokens": 1})[0].weight_version == "v-client"
    with EngineClient(both_keys.url, api_key=API, timeout=60) as generate_only:
        assert generate_only.generate([[1, 4]], {"max_new_tokens": 1})
        with pytest.raises(EngineError) as err:
            generate_only.update_weight_version("v-nope")
        assert (err.value.status, err.value.message) == (401, "Unauthorized")
    with EngineClient(both_keys.url, admin_api_key=ADMIN, timeout=60) as admin_only_client:
        with pytest.raises(EngineError) as err:
            admin_only_client.generate([[1, 4]], {"max_new_tokens": 1})
        assert err.value.status == 401


def test_the_keys_never_reach_argv(admin_only, both_keys):
    for engine in (admin_only, both_keys):
        argv = Path(f"/proc/{engine.proc.pid}/cmdline").read_bytes().decode()
        assert ADMIN not in argv and API not in argv and "kora_engine.lm" in argv


def test_the_decision_table_is_sglangs():
    h = {"Authorization": "Bearer k"}
    assert route_level("/health_generate") is Level.OPEN and route_level("/metrics") is Level.OPEN
    assert route_level("/kora/anything") is Level.ADMIN and route_level("/generate") is Level.NORMAL
    assert allowed("POST", "/flush_cache", {}, None, None)  # no keys: all open
    assert allowed("POST", "/flush_cache", h, "k", None)  # api key only: it opens admin routes too
    assert not allowed("POST", "/flush_cache", h, "k", "a")  # both: only the admin key does
    assert allowed("POST", "/generate", {}, None, "a")  # admin key only: normal routes open
    assert not allowed("POST", "/generate", {"Authorization": "Bearer a"}, "k", "a")
    assert allowed("GET", "/health", {}, "k", "a") and allowed("OPTIONS", "/flush_cache", {}, "k", "a")
    assert not allowed("POST", "/flush_cache", {"Authorization": "Bearer ä"}, None, "a")  # non-ASCII: no TypeError
    assert not allowed("POST", "/flush_cache", {"Authorization": "Basic a"}, None, "a")
    assert engine_auth.key_for("/pause_generation", "k", None) == "k"  # the client falls back as SGLang does
    assert engine_auth.key_for("/health", "k", "a") is None
    assert len(new_admin_key()) >= 43 and new_admin_key() != new_admin_key()
