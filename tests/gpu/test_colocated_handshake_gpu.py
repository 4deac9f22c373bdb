"""The colocated push handshake on a GPU (wire/colocated_words.py): the trainer (the torch backend on cuda) and the
reference engine share GPU 0, the engine's weights / adapter ring mapped once through CUDA IPC, each Merge or
EngineMerge push told to the engine in shared memory — the engine's watcher thread takes its weight lock (Merge) or
folds the ring slot on its device (EngineMerge: the folds planned once, replayed as one CUDA graph; an armed push's
gather and fold enqueued at its arm behind a kernel waiting on the GATE word, an arm that no push follows undone,
a wrongly armed slot not touched). A steady-state
push makes no HTTP call (the engine records every request it answers) and the engine then serves the pushed policy
at the pushed version. tests/unit/test_sync_colocated_handshake.py is the same on the CPU, with the concurrency and
timeout cases.

Run: PYTHONPATH=$PWD/trainer:$PWD/engine:$PWD/tests pytest -m gpu tests/gpu/test_colocated_handshake_gpu.py
Tolerance: fp32 on both sides; 1e-3 as the other GPU sync tests (TF32 off, batching and KV cache reorder sums).
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from engine_helpers import (
    armed_push_that_never_comes,
    colocated_sender,
    logprob_gap,
    misarmed_push,
    recording_engine,
    reset_to_checkpoint,
    skip_under_threshold_keeps_what_is_served,
    steady_state_pushes,
    step,
    trained_policy,
)
from kora_trainer.sync.sender import POLICY_ADAPTER

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ATOL = 1e-3
CAP = "64Ki"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    with recording_engine(tmp_path_factory, "--dtype", "float32", device="cuda") as up:
        yield up


@pytest.fixture(autouse=True)
def base_weights(recorded):
    """Every test starts from the checkpoint's weights (`reset_to_checkpoint` says why)."""
    reset_to_checkpoint(recorded[1], recorded[0])


@pytest.mark.parametrize(("mode", "seed"), [("Merge", 61), ("EngineMerge", 62), ("Adapter", 63)])
def test_a_colocated_push_on_the_gpu_makes_no_http_call(recorded, mode, seed):
    model_dir, engine, record = recorded
    b = trained_policy(model_dir, mode, seed, CAP, device="cuda")
    lora_path = POLICY_ADAPTER if mode == "Adapter" else None
    with engine.client(timeout=120) as client:
        sender = colocated_sender(b, client)
        first = sender.sync(version=1)
        assert first.path == "http" and first.note.startswith("fast path on (colocated"), first.note
        assert mode == "Adapter" or "push handshake in shared memory" in first.note, first.note
        assert sender.flat is not None and sender.flat.is_cuda
        step(b)
        assert sender.sync(version=2).path == "fast"  # verified: one checksum call
        assert logprob_gap(client, b, lora_path) < ATOL
        times = steady_state_pushes(sender, b, client, record, range(3, 9), lora_path, ATOL,
                                    prelaunch=mode == "EngineMerge")
        if mode == "EngineMerge":  # one context for the push: the engine gathers, folds and decides
            assert sender.engine_gathers
            skip_under_threshold_keeps_what_is_served(sender, b, client, version=9)
            misarmed_push(sender, b, client, version=10, atol=ATOL)
            armed_push_that_never_comes(sender, b, client)  # the prelaunch undone after ARM_S
            times += steady_state_pushes(sender, b, client, record, range(12, 14), lora_path, ATOL, prelaunch=True)
    print(json.dumps({"test": "colocated_handshake_gpu", "mode": mode, "push_ms": times,
                      "push_ms_p50": statistics.median(times)}))
