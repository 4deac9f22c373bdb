"""The colocated fast path's per-push handshake in shared memory (wire/colocated_words.py, issue 17): against a real
`reference_engine` process that records every HTTP request it answers (kora_engine/lm/record.py), a steady-state
Merge, EngineMerge or Adapter push makes no HTTP call at all; versions stay exact while generation runs through the
pushes (each rollout's log-probs are the trainer's policy at the version it reports); an engine that stops answering
fails the push within the transport's timeout with an error naming it and what it did not answer, and the next push
lands once it is back; and the engine's side of the Merge lock (grant, done, withdraw, a lease that runs out) keeps
generation off half-written weights.

Tolerance: ATOL from engine_helpers (fp32 on both sides; only summation order differs).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from engine_helpers import (
    ATOL,
    armed_push_that_never_comes,
    colocated_sender,
    logprob_gap,
    misarmed_push,
    recorded_calls,
    recording_engine,
    reset_to_checkpoint,
    skip_under_threshold_keeps_what_is_served,
    steady_state_pushes,
    step,
    trained_policy,
    wait_engine_state,
)
from kora_trainer.sync.sender import POLICY_ADAPTER
from kora_trainer.sync.transport import SyncError
from kora_trainer.wire.colocated_words import ACK, DARG, DONE, ERR, ERR_TORN, GRANT, REQ, Waker, Words, wait_word
from kora_trainer.wire.fast_receive import doorbell_value
from kora_trainer.wire.serialize import deserialize_payload
from localcluster import wait_for

pytestmark = pytest.mark.timeout(240)
CAP = "64Ki"
PROMPT = [1, 4, 5, 13, 6]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    with recording_engine(tmp_path_factory) as up:
        yield up


@pytest.fixture(autouse=True)
def base_weights(recorded):
    """Every test starts from the checkpoint's weights (`reset_to_checkpoint` says why)."""
    reset_to_checkpoint(recorded[1], recorded[0])


def lora_path(mode: str) -> str | None:
    return POLICY_ADAPTER if mode == "Adapter" else None


@pytest.mark.parametrize(("mode", "seed"), [("Merge", 51), ("EngineMerge", 52), ("Adapter", 53)])
def test_a_steady_state_push_makes_no_http_call(recorded, mode, seed):
    model_dir, engine, record = recorded
    b = trained_policy(model_dir, mode, seed, CAP)
    with engine.client() as client:
        sender = colocated_sender(b, client)
        assert sender.sync(version=1).path == "http"
        step(b)
        before = len(recorded_calls(record))
        first = sender.sync(version=2)  # the first fast push is a verified one: one checksum call, no push call
        assert first.path == "fast" and first.what == {"Merge": "adapted", "EngineMerge": "lora_pairs",
                                                       "Adapter": "adapter"}[mode]
        assert [c["path"] for c in recorded_calls(record)[before:]] == [
            "/kora/colocated/push" if mode == "Adapter" else "/kora/colocated/checksum"]
        # where the push's time went: the parts add up to its time; the verification is reported beside it
        engine_own = {"engine_spent", "engine_wake", "engine_lock", "engine_launch", "engine_launch_cpu",
                      "engine_wait", "engine_after", "ack_notice", "engine_prelude",
                      "engine_gather_launch"}  # inside "engine"
        parts = {"Merge": {"decide", "lock", "write", "ack"}, "EngineMerge": {"sync", "engine"} | engine_own,
                 "Adapter": {"decide", "ring"}}[mode]
        assert set(first.phases) == parts | {"verify_ms"}, first.phases
        assert sum(v for k, v in first.phases.items() if k not in engine_own | {"verify_ms"}) \
            == pytest.approx(first.ms, abs=0.05)
        if mode == "EngineMerge":
            p = first.phases
            moments = ["engine_wake", "engine_lock", "engine_launch", "engine_wait", "engine_after", "ack_notice"]
            assert min(p[m] for m in moments) >= 0  # one clock for both processes: the moments are in order
            # from the request's store to its ACK seen: all of "engine" (the engine gathers, folds and decides)
            assert p["engine"] - 0.05 <= sum(p[m] for m in moments) <= first.ms + 0.05
            assert 0 < p["engine_launch_cpu"] <= p["engine_launch"] + p["engine_lock"] + 0.01  # CPU within wall
            # the moments inside the lock and the launch: the handler's own work, then the gather enqueued
            assert 0 <= p["engine_prelude"] <= p["engine_lock"] and 0 <= p["engine_gather_launch"] <= p["engine_launch"]
        steady_state_pushes(sender, b, client, record, (3, 4, 5), lora_path(mode), ATOL)
        skipped = sender.sync(version=6)  # delta-skip: Merge asked for the lock and gave it back unused
        assert not skipped.pushed and skipped.adapter_version == 5
        assert client.generate([PROMPT], {"max_new_tokens": 1}, lora_path=lora_path(mode))[0].weight_version == "5"
        if mode == "EngineMerge":  # the engine gathered and decided the skip: it folded, then put v5 back
            assert sender.engine_gathers and skipped.phases["engine"] > 0
            skip_under_threshold_keeps_what_is_served(sender, b, client, version=7)
            steady_state_pushes(sender, b, client, record, (8, 9), lora_path(mode), ATOL)  # the slot after a skip
            misarmed_push(sender, b, client, version=10, atol=ATOL)
            armed_push_that_never_comes(sender, b, client)
            steady_state_pushes(sender, b, client, record, (12, 13), lora_path(mode), ATOL)


def snapshot(b) -> list[torch.Tensor]:
    return [p.detach().clone() for p in b.params]


@pytest.mark.parametrize(("mode", "seed"), [("Merge", 54), ("EngineMerge", 55)])
def test_versions_stay_exact_while_generation_runs_through_the_pushes(recorded, mode, seed):
    """One-token rollouts (a prefill: no step boundary inside, so none spans a write) run back to back on another
    connection while the trainer pushes: every rollout's log-prob is the trainer's policy at the version it
    reports, and policies of neighbouring versions differ by far more than ATOL."""
    model_dir, engine, _ = recorded
    b = trained_policy(model_dir, mode, seed, CAP)
    seen: list[tuple[str, list[int], list[float]]] = []
    stop = threading.Event()
    with engine.client() as client, engine.client() as other:
        sender = colocated_sender(b, client)
        sender.sync(version=1)
        policies = {"1": snapshot(b)}

        def generate() -> None:
            while not stop.is_set():
                out = other.generate([PROMPT], {"max_new_tokens": 1, "temperature": 1.0})[0]
                seen.append((str(out.weight_version), out.output_ids, out.output_logprobs))

        gen = threading.Thread(target=generate, daemon=True)
        gen.start()
        try:
            for version in range(2, 7):
                step(b, 0.05 if version % 2 else -0.04)
                policies[str(version)] = snapshot(b)
                have = len(seen)
                assert sender.sync(version=version).path == "fast"
                wait_for(lambda have=have: len(seen) >= have + 3, timeout=30, interval=0.01,
                         what=f"rollouts after the push of version {version}")
        finally:
            stop.set()
            gen.join(30)
    assert {v for v, _, _ in seen} >= {str(v) for v in range(2, 7)}, sorted({v for v, _, _ in seen})
    worst: dict[str, float] = {}
    with torch.no_grad():
        for version, params in policies.items():
            rollouts = [(ids, lps) for v, ids, lps in seen if v == version]
            if not rollouts:
                continue
            for p, saved in zip(b.params, params, strict=True):
                p.copy_(saved)
            ours = b.logprobs([PROMPT] * len(rollouts), [ids for ids, _ in rollouts])
            worst[version] = max(abs(x - y) for (_, lps), mine in zip(rollouts, ours, strict=True)
                                 for x, y in zip(lps, mine, strict=True))
    assert max(worst.values()) < ATOL, f"a rollout's log-probs are not its reported version's policy: {worst}"


@pytest.mark.parametrize(("mode", "seed"), [("Merge", 58), ("EngineMerge", 59)])
def test_a_push_waits_one_step_not_the_generation_in_flight(recorded, mode, seed):
    """Issue 17 item 2 through the handshake: a push made while a long generation runs lands at the generation's
    next step boundary, not after it; the generation goes on under the new weights and reports the version it
    started under (it spanned the write), and the next rollout reports the pushed version."""
    model_dir, engine, _ = recorded
    b = trained_policy(model_dir, mode, seed, CAP)
    outs: list = []
    with engine.client() as client, engine.client() as other:
        sender = colocated_sender(b, client)
        sender.sync(version=1)
        step(b)
        assert sender.sync(version=2).path == "fast"
        params = {"max_new_tokens": 240, "temperature": 0.0, "ignore_eos": True}
        gen = threading.Thread(target=lambda: outs.extend(other.generate([[1, 2 + i] for i in range(8)], params)))
        gen.start()
        wait_engine_state(client, "the long generation admitted", in_flight=8)
        step(b, -0.04)
        report = sender.sync(version=3)
        held = not outs  # still generating: it gave the weights up mid-way
        gen.join(120)
        assert report.pushed and report.path == "fast"
        assert held, "the push waited for the whole generation in flight"
        assert [len(o.output_ids) for o in outs] == [240] * 8
        assert {o.weight_version for o in outs} == {"2"}  # it spanned the write: the version it started under
        assert client.generate([PROMPT], {"max_new_tokens": 1})[0].weight_version == "3"
        assert logprob_gap(client, b, None) < ATOL


def all_stopped(pid: int) -> bool:
    """Every thread of `pid` stopped (a signal is delivered asynchronously: kill() returns before)."""
    tasks = os.listdir(f"/proc/{pid}/task")
    return all(open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] in "Tt" for t in tasks)


@pytest.mark.parametrize(("mode", "seed", "unanswered"), [
    ("Merge", 56, "did not grant its weight lock"), ("EngineMerge", 57, "did not acknowledge push")])
def test_an_engine_that_stops_answering_fails_the_push_within_the_timeout(recorded, mode, seed, unanswered):
    """The engine's process stopped (SIGSTOP: alive, answering nothing): the push fails after the transport's
    timeout with a SyncError naming the engine and the word it did not write, not a hang; resumed, it answers the
    request it missed and the next push lands."""
    model_dir, engine, _ = recorded
    b = trained_policy(model_dir, mode, seed, CAP)
    with engine.client() as client:
        sender = colocated_sender(b, client)
        sender.sync(version=1)
        step(b)
        assert sender.sync(version=2).path == "fast"
        sender.transport.timeout_s = 1.0
        step(b, -0.04)
        os.kill(engine.proc.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: all_stopped(engine.proc.pid), timeout=10, interval=0.01, what="the engine stopped")
            t0 = time.monotonic()
            with pytest.raises(SyncError) as hung:
                sender.sync(version=3)
            took = time.monotonic() - t0
        finally:
            os.kill(engine.proc.pid, signal.SIGCONT)
        message = str(hung.value)
        assert unanswered in message and engine.url in message and "within 1 s" in message, message
        assert took < 5, f"the push took {took:.1f} s to fail with a 1 s timeout"
        sender.transport.timeout_s = 60.0
        step(b)
        report = sender.sync(version=4)
        assert report.pushed and report.path == "fast"
        assert logprob_gap(client, b, None) < ATOL
        assert client.generate([PROMPT], {"max_new_tokens": 1})[0].weight_version == "4"


def test_the_engine_side_of_the_merge_lock(recorded):
    """Driven word by word: a grant holds the weights (a generation waits) until DONE; DONE -n gives them back with
    the version unchanged, DONE n sets the version; a writer that never finishes loses the weights as torn after
    its lease (ACK -n, ERR_TORN) and generation goes on."""
    _, engine, _ = recorded
    with engine.client() as client, engine.client() as other:
        answer = client.colocated("plan", {"mode": "Merge", "lease_s": 0.5})
        words = Words(dict(deserialize_payload(answer["payload"]))["handshake"])
        wake = Waker(answer["wake"])
        assert wake.problem is None
        client.update_weight_version("before")

        def request(n: int) -> None:
            words[REQ] = n
            wake()
            wait_word(words, GRANT, lambda v: v == n, 10, f"the grant of {n}")

        def done(n: int, value: int, darg: int = 0) -> int:
            words[DARG] = darg
            words[DONE] = value
            wake()
            return wait_word(words, ACK, lambda v: abs(v) == n, 10, f"the answer to {n}")

        request(1)
        finished = threading.Event()
        outs: list = []
        gen = threading.Thread(target=lambda: (outs.extend(other.generate([[1, 2]], {"max_new_tokens": 1})),
                                               finished.set()))
        gen.start()
        wait_engine_state(client, "the generation admitted", in_flight=1)
        assert not finished.wait(0.3), "a generation ran while a Merge grant held the weights"
        assert done(1, -1) == 1  # withdrawn: the lock back, nothing changed
        assert finished.wait(30)
        gen.join()
        assert outs[0].weight_version == "before"
        request(2)
        assert done(2, 2, doorbell_value(7, 0)) == 2
        assert client.generate([[1, 2]], {"max_new_tokens": 1})[0].weight_version == "7"
        words[REQ] = 3
        wake()
        assert wait_word(words, ACK, lambda v: abs(v) == 3, 10, "the lease of 3") == -3  # never DONE: 0.5 s lease
        assert words[ERR] == ERR_TORN
        assert client.generate([[1, 2]], {"max_new_tokens": 1})[0].weight_version == "torn"
        wake.close()
        client.update_weight_version("default")
