"""The rollout manager over several real reference engines (processes on 127.0.0.1, started as the trainer
starts them, with a per-job admin key): a step is spread over every engine, a busy engine gets less, an
engine killed mid-step or down at the start is taken out and its requests served by the others, no engine
left is a clear RolloutError, and seeded samples do not depend on which engine served them.

Busy and killed engines are made by pausing one (`/pause_generation` in_place holds the requests that
arrive); every wait polls an observable state (the manager's `load`, the engine's /kora/state), bounded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kora_trainer.config import load_config
from kora_trainer.orchestration.engines import EngineProcess
from kora_trainer.orchestration.rollout_manager import Rollout, RolloutError
from kora_trainer.wire.engine_auth import new_admin_key
from kora_trainer.wire.engine_client import EngineClient
from kora_trainer.wire.ports import free_port
from localcluster import wait_for
from tinymodel import make_tiny_model

pytestmark = pytest.mark.timeout(240)
KEY = new_admin_key()


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("job")
    make_tiny_model(root / "tiny")
    rows = [{"prompt": f"{i}+{i % 7}=", "label": str(i + i % 7)} for i in range(40)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def config(job: Path, *overrides: str):
    cfg, _ = load_config(None, [f"model.path={job / 'tiny'}", f"data.path={job / 'train.jsonl'}",
                                "data.inputKey=prompt", "data.labelKey=label", "lora.rank=4", "rollout.engine=hf",
                                "rollout.gpusPerEngine=0", "algorithm.maxNewTokens=4", *overrides])
    return cfg


def start(job: Path, index: int) -> EngineProcess:
    return EngineProcess.start(config(job), job / "logs", threads=1, index=index, admin_api_key=KEY, timeout_s=120)


@pytest.fixture(scope="module")
def engines(job) -> Iterator[list[EngineProcess]]:
    pair = [start(job, 0), start(job, 1)]
    yield pair
    for e in pair:
        e.stop()


def admin(engine: EngineProcess) -> EngineClient:
    return EngineClient(engine.url, admin_api_key=KEY, timeout=60)


def in_background(fn: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # the test thread re-raises it
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def joined(thread: threading.Thread, box: dict[str, Any], timeout_s: float = 120.0) -> Any:
    thread.join(timeout_s)
    assert not thread.is_alive(), "the step did not finish"
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_a_step_is_spread_over_every_engine(job, engines):
    cfg = config(job, "algorithm.rolloutBatchSize=8", "algorithm.nSamplesPerPrompt=2")
    rollout = Rollout(cfg, [e.url for e in engines], admin_api_key=KEY)
    try:
        batch, stats = rollout.generate(1)
    finally:
        rollout.close()
    assert len(batch.response_ids) == 16 and all(batch.response_ids)
    assert stats["engine_requests"] == [8, 8] and stats["engines_out"] == {}
    assert batch.prompt_ids[0] == batch.prompt_ids[1] != batch.prompt_ids[2]  # a prompt's samples adjacent


def test_a_busy_engine_gets_fewer_requests(job, engines):
    # 16 one-sample calls, 4 in flight per engine at most: B holds its first 4 (paused), A serves the other 12
    cfg = config(job, "algorithm.rolloutBatchSize=16", "algorithm.nSamplesPerPrompt=1")
    rollout = Rollout(cfg, [e.url for e in engines])
    busy = admin(engines[1])
    try:
        busy.pause_generation("in_place")
        try:
            thread, box = in_background(rollout.generate, 1)
            wait_for(lambda: rollout.load.queued == 0 and rollout.load.outstanding == [0, 4], timeout=120,
                     interval=0.05, what="engine A done with all but the 4 calls engine B holds")
            assert busy.request("GET", "/kora/state")["held_requests"] == 4
        finally:
            busy.continue_generation()
        batch, stats = joined(thread, box)
    finally:
        busy.close()
        rollout.close()
    assert stats["engine_requests"] == [12, 4] and len(batch.response_ids) == 16


def test_an_engine_killed_mid_step_leaves_the_step_to_the_others(job, engines):
    doomed = start(job, 2)
    cfg = config(job, "algorithm.rolloutBatchSize=8", "algorithm.nSamplesPerPrompt=2")
    rollout = Rollout(cfg, [engines[0].url, doomed.url])
    try:
        with admin(doomed) as c:
            c.pause_generation("in_place")
            thread, box = in_background(rollout.generate, 1)
            wait_for(lambda: c.request("GET", "/kora/state")["held_requests"] > 0, timeout=60, interval=0.05,
                     what="the doomed engine holding part of the step")
        doomed.proc.kill()  # by pid: connections cut mid-call
        doomed.proc.wait(timeout=30)
        batch, stats = joined(thread, box)
        assert len(batch.response_ids) == 16 and all(batch.response_ids)
        assert stats["engine_requests"] == [16, 0] and list(stats["engines_out"]) == [doomed.url]
        # the next step: the dead engine fails /health and is out from the start
        batch, stats = rollout.generate(2)
        assert stats["engine_requests"] == [16, 0] and "GET /health" in stats["engines_out"][doomed.url]
    finally:
        rollout.close()
        doomed.stop()


def test_no_engine_left_is_a_clear_error(job):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    rollout = Rollout(config(job, "algorithm.rolloutBatchSize=2"), dead, health_timeout_s=5)
    try:
        with pytest.raises(RolloutError, match=r"step 3: no rollout engine left") as err:
            rollout.generate(3)
    finally:
        rollout.close()
    assert all(url in str(err.value) for url in dead)


def test_seeded_samples_do_not_depend_on_the_engine_that_served_them(job, engines, tmp_path):
    # a run that claims exact resume sends per-sample seeds; the same step on A+B, B+A, A alone, B alone
    cfg = config(job, f"checkpoint.path={tmp_path}", "deployment.async=false", "algorithm.rolloutBatchSize=6",
                 "algorithm.nSamplesPerPrompt=3", "algorithm.temperature=1.0")
    a, b = (e.url for e in engines)
    runs = {}
    for name, urls in {"ab": [a, b], "ba": [b, a], "a": [a], "b": [b]}.items():
        rollout = Rollout(cfg, urls)
        try:
            assert rollout.seeded
            batch, stats = rollout.generate(5)
        finally:
            rollout.close()
        runs[name] = (batch.response_ids, batch.rollout_logprobs, stats["engine_requests"])
    assert runs["ab"][2] == [9, 9] and runs["ba"][2] == [9, 9]  # both served: prompt 0 by A, then by B
    samples = runs["a"][0]
    assert all(run[0] == samples for run in runs.values())
    for run in runs.values():
        assert all(x == pytest.approx(y, abs=1e-5) for xs, ys in zip(run[1], runs["a"][1], strict=True)
                   for x, y in zip(xs, ys, strict=True))
    assert len({tuple(s) for s in samples[:3]}) > 1 or len({tuple(s) for s in samples[3:6]}) > 1  # seeds differ
