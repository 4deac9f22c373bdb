"""An engine that hangs without dying is killed by its HangWatch within rollout.engineHangSeconds (plus one probe),
so the call in flight fails at once instead of waiting out its own timeout: a real reference engine that SIGSTOPs
itself, or wedges its event loop, inside a /generate (kora_engine/faults.py); and a real process that accepts
connections and never answers one. A healthy engine gets a verdict at once and is left alone."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from engine_helpers import start_engine, stop_engine
from kora_engine.faults import HANG_AT_ENV, HANG_MARK, parse_hang_at
from kora_trainer.orchestration.engine_watch import HangWatch
from kora_trainer.wire.engine_client import EngineClient, EngineError
from kora_trainer.wire.ports import free_port
from localcluster import wait_for

HANG_S = 2.0
SLACK_S = 3.0  # one probe interval (0.4 s here) plus a loaded machine's scheduling


def test_hang_at_parses_route_count_and_how():
    assert parse_hang_at("/generate:3:stop") == ("/generate", 3, "stop")
    assert parse_hang_at("/update_weights_from_distributed:1:wedge") == ("/update_weights_from_distributed", 1,
                                                                          "wedge")
    assert parse_hang_at(None) is None and parse_hang_at("") is None
    for bad in ("/generate:3", "/generate:3:sleep", "generate:3:stop", "/generate:0:stop"):
        with pytest.raises(ValueError, match=HANG_AT_ENV):
            parse_hang_at(bad)


@pytest.mark.parametrize(("how", "state"), [("stop", "stopped (SIGSTOP)"), ("wedge", "sleeping")])
def test_an_engine_hung_inside_a_generate_is_killed_within_the_bound(toy_dir, tmp_path, how, state):
    engine = start_engine(toy_dir, tmp_path, env={HANG_AT_ENV: f"/generate:2:{how}"})
    watch = HangWatch(engine.proc, engine.url, HANG_S)
    try:
        with EngineClient(engine.url, timeout=600) as client:
            client.generate([[1, 4, 5, 13]], {"max_new_tokens": 2, "temperature": 0.0})  # the first one answers
            t0 = time.monotonic()
            watch.settle(10)  # healthy: a fresh answered probe, no verdict
            assert time.monotonic() - t0 < 5 and watch.hung == "" and engine.proc.poll() is None
            call = client.submit(client.generate, [[1, 4, 5, 13]], {"max_new_tokens": 2, "temperature": 0.0})
            wait_for(lambda: HANG_MARK in engine.log.read_text(errors="replace"), 30, 0.02, "the engine to hang")
            hung_at = time.monotonic()
            with pytest.raises(EngineError):  # the call in flight fails once the engine is killed (timeout: 600 s)
                call.result(timeout=HANG_S + SLACK_S + 5)
            failed_s = time.monotonic() - hung_at
        watch.settle(5)  # the driver's way to the verdict (the kill and its reaping may still be under way)
        assert engine.proc.poll() == -9, engine.proc.poll()
        assert HANG_S <= failed_s < HANG_S + SLACK_S, failed_s
        assert "GET /health unanswered for" in watch.hung and state in watch.hung, watch.hung
        assert "rollout.engineHangSeconds 2" in watch.hung, watch.hung
    finally:
        watch.stop()
        if engine.proc.poll() is None:
            stop_engine(engine)


def test_a_process_that_accepts_and_never_answers_is_killed(tmp_path):
    port = free_port()
    code = ("import socket, time\n"
            f"s = socket.create_server(('127.0.0.1', {port}))\n"
            "print('listening', flush=True)\n"
            "held = []\n"
            "while True:\n"
            "    held.append(s.accept())  # accepted, read from never, answered never\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        t0 = time.monotonic()
        watch = HangWatch(proc, f"http://127.0.0.1:{port}", HANG_S)
        wait_for(lambda: proc.poll() is not None, HANG_S + SLACK_S, 0.05, "the watch to kill it")
        assert HANG_S <= time.monotonic() - t0 < HANG_S + SLACK_S
        assert proc.returncode == -9 and "unanswered" in watch.hung and "sleeping" in watch.hung, watch.hung
        watch.stop()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
