"""The reference diffusion engine as a real process on 127.0.0.1 (sglang-diffusion's `POST /rollout/generate` and
`POST /update_weights_from_tensor`): its rollouts, re-scored by the trainer in this process, give back every step's
log-prob exactly, before and after IPC-merge and train-side-merge pushes; what it cannot serve is a 400 that names
the field, never a 5xx."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import requests
import torch

from diffusionkit import toy_with_moved_adapter
from kora_trainer.algorithm import flow_grpo
from kora_trainer.backends.diffusion.train_loop import FlowGRPOSettings, train_toy
from kora_trainer.lora.model import adapter_tensors, base_state, folded_state
from kora_trainer.toys.diffusion import load_diffusion_toy
from kora_trainer.toys.diffusion_policy import velocity_fn
from kora_trainer.wire.diffusion import decode_tensor, trajectory_from_responses
from kora_trainer.wire.diffusion_client import EngineRollout, LoraMergeSync
from kora_trainer.wire.diffusion_lora import layer_groups, pack_pair_buckets, sync_log_line
from kora_trainer.wire.ports import free_port
from kora_trainer.wire.serialize import serialize_named_tensors
from localcluster import wait_for


@pytest.fixture(scope="module")
def engine_url(diffusion_toy_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("diffusion-engine") / "engine.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kora_engine.diffusion.server", "--toy", str(diffusion_toy_dir),
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: requests.get(f"{url}/health", timeout=2).status_code == 200, timeout=120,
                 what=f"the diffusion engine's /health (log {log})")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _generate(url: str, **body):
    return requests.post(f"{url}/rollout/generate", data=json.dumps(body), timeout=60)


def test_the_engines_rollout_log_probs_equal_the_trainers_rescore(engine_url, diffusion_toy_dir):
    resp = _generate(engine_url, prompt="colour-03", seed=11, num_inference_steps=10, num_outputs_per_prompt=3,
                     rollout_noise_level=0.7, rollout_return_dit_trajectory=True, some_future_field=1)
    assert resp.status_code == 200 and resp.headers["Content-Type"] == "application/msgpack"
    responses = msgpack.unpackb(resp.content)
    assert len(responses) == 3 and {r["seed"] for r in responses} == {11}
    assert decode_tensor(responses[0]["generated_output"]).shape == (4, 8, 8)
    traj = trajectory_from_responses(responses, noise_level=0.7)
    assert traj.latents.shape == (3, 11, 4, 8, 8) and traj.log_probs.shape == (3, 10)
    assert torch.equal(traj.images, torch.stack([decode_tensor(r["generated_output"]) for r in responses]))
    toy = load_diffusion_toy(diffusion_toy_dir)
    toy.transformer.eval()
    ids = torch.full((3,), 3)
    with torch.no_grad():
        worst = max(float((flow_grpo.rescore(velocity_fn(toy, ids), traj, j)[0] - traj.log_probs[:, j]).abs().max())
                    for j in range(10))
    assert worst < 1e-5, worst
    # the same seed gives the same images; the outputs of one request differ from each other
    again = trajectory_from_responses(msgpack.unpackb(_generate(
        engine_url, prompt="colour-03", seed=11, num_inference_steps=10, num_outputs_per_prompt=3,
        rollout_return_dit_trajectory=True).content), noise_level=0.7)
    assert torch.equal(again.latents, traj.latents) and not torch.equal(traj.images[0], traj.images[1])


def test_a_guided_rollout_is_what_the_trainer_rescores_with_the_same_guidance(engine_url, diffusion_toy_dir):
    """guidance_scale 4.5 (CFG): every step's log-prob is the trainer's re-score with the guided velocity to
    rounding, the unguided re-score misses it, and the images differ from the unguided ones of the same seed."""
    body = {"prompt": "colour-05", "seed": 3, "num_inference_steps": 6, "num_outputs_per_prompt": 2,
            "rollout_return_dit_trajectory": True}
    guided = trajectory_from_responses(msgpack.unpackb(_generate(engine_url, **body, guidance_scale=4.5,
                                                                 negative_prompt="").content), noise_level=0.7)
    plain = trajectory_from_responses(msgpack.unpackb(_generate(engine_url, **body, guidance_scale=1.0).content),
                                      noise_level=0.7)
    toy = load_diffusion_toy(diffusion_toy_dir)
    toy.transformer.eval()
    ids = torch.full((2,), 5)

    def gap(guidance):
        with torch.no_grad():
            return max(float((flow_grpo.rescore(velocity_fn(toy, ids, guidance=guidance), guided, j)[0]
                              - guided.log_probs[:, j]).abs().max()) for j in range(guided.num_steps))
    assert gap(4.5) < 1e-5, gap(4.5)
    assert gap(1.0) > 1e-3, gap(1.0)
    assert not torch.allclose(guided.images, plain.images, atol=1e-3)


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "a cat"}, "prompt"),
    ({"prompt": "colour-01", "guidance_scale": 4.5, "negative_prompt": "blurry"}, "negative_prompt"),
    ({"prompt": "colour-01", "rollout_sde_type": "cps"}, "rollout_sde_type"),
    ({"prompt": "colour-01", "width": 512}, "width/height"),
    ({"prompt": "colour-01", "num_outputs_per_prompt": 10_000}, "num_outputs_per_prompt"),
    ({"prompt": "colour-01", "rollout_noise_level": "loud"}, "rollout_noise_level"),
    ({"seed": 1}, "prompt"),
])
def test_what_the_engine_cannot_serve_is_a_400_naming_the_field(engine_url, body, field):
    resp = _generate(engine_url, **body)
    assert resp.status_code == 400 and field in resp.json()["detail"], resp.text


def test_a_body_that_is_not_json_is_a_400(engine_url):
    resp = requests.post(f"{engine_url}/rollout/generate", data=b"\x93not json", timeout=30)
    assert resp.status_code == 400


def _push(url, named, **fields):
    body = {"serialized_named_tensors": [serialize_named_tensors(named)], "target_modules": ["transformer"], **fields}
    return requests.post(f"{url}/update_weights_from_tensor", data=json.dumps(body), timeout=60)


def _engine_rollout(url):
    return trajectory_from_responses(msgpack.unpackb(_generate(
        url, prompt="colour-07", seed=5, num_inference_steps=6, num_outputs_per_prompt=4,
        rollout_return_dit_trajectory=True).content), noise_level=0.7)


def _rescore_gap(toy, traj):
    ids = torch.full((traj.latents.shape[0],), 7)
    with torch.no_grad():
        return max(float((flow_grpo.rescore(velocity_fn(toy, ids), traj, j)[0] - traj.log_probs[:, j]).abs().max())
                   for j in range(traj.num_steps))


def test_ipc_merge_and_train_side_merge_pushes_serve_the_trainers_policy(engine_url, diffusion_toy_dir):
    """Last in this module: it changes the engine's weights (and puts the base back at the end)."""
    toy = toy_with_moved_adapter(diffusion_toy_dir)  # the trainer's policy: LoRA r 4 / alpha 8, B moved
    assert _rescore_gap(toy, _engine_rollout(engine_url)) > 1e-4  # the engine still serves the base
    groups, unmapped = layer_groups(adapter_tensors(toy.transformer))
    buckets = pack_pair_buckets(groups, cap_bytes=4 * groups[0].nbytes)
    try:
        for _ in range(2):  # the second sync of the same adapter must not add it twice
            for bucket in buckets:
                resp = _push(engine_url, [t for g in bucket for t in g.named()], weight_update_mode="lora_merge",
                             lora_alpha=8, lora_rank=4)
                assert resp.status_code == 200 and resp.json()["success"], resp.text
            merged = _engine_rollout(engine_url)
            assert _rescore_gap(toy, merged) < 1e-5  # the engine serves exactly the trainer's policy
        print(sync_log_line(1, "transformer", buckets, len(unmapped)))
        # train-side merge: the trainer folds (fp32, rounded once) and pushes full weights under diffusers' names
        resp = _push(engine_url, list(folded_state(toy.transformer)))
        assert resp.status_code == 200, resp.text
        assert torch.equal(_engine_rollout(engine_url).latents, merged.latents)  # the same weights, bit for bit
        # a bucket carrying half a pair is refused, naming the rule
        half = _push(engine_url, groups[0].named()[:1], weight_update_mode="lora_merge", lora_alpha=8, lora_rank=4)
        assert half.status_code == 400 and "whole A/B pairs" in half.json()["message"]
        bad = _push(engine_url, groups[0].named(), weight_update_mode="lora_merge", load_format="flattened_bucket",
                    lora_alpha=8, lora_rank=4)
        assert bad.status_code == 400 and "load_format" in bad.json()["message"]
    finally:
        assert _push(engine_url, list(base_state(toy.transformer))).status_code == 200


@pytest.mark.slow
def test_training_through_the_engine_with_ipc_merge_raises_the_reward(engine_url, diffusion_toy_dir):
    """Rollouts from the engine, the adapter pushed by IPC merge after every update: every step's ratio is 1 (the
    engine served exactly the pushed policy, step after step) and the reward rises as it does in one process."""
    torch.set_num_threads(1)
    settings = FlowGRPOSettings()
    sync = LoraMergeSync(engine_url, settings.lora_rank, settings.lora_alpha, buffer_bytes=64 << 10)
    roll = EngineRollout(engine_url, settings.seed, settings.num_inference_steps, settings.noise_level)
    try:
        out = train_toy(diffusion_toy_dir, settings, steps=40, rollout=roll, sync=sync)
    finally:
        toy = load_diffusion_toy(diffusion_toy_dir)
        assert _push(engine_url, list(base_state(toy.transformer))).status_code == 200
    print({k: out[k] for k in ("reward_before", "reward_after", "train_s")}, sync.lines[0])
    assert sync.lines[0].endswith("pushed 30 lora tensors, 15 layer prefixes in 2 buckets (unmapped=0)")
    assert all(abs(h["ratio_mean"] - 1.0) < 1e-6 for h in out["history"])
    assert out["reward_after"] - out["reward_before"] >= 0.05


def test_the_engine_answers_health_while_a_rollout_runs(engine_url):
    """Rollouts run off the event loop (one at a time), so GET /health answers at once throughout: the trainer's hang
    watch (orchestration/engine_watch.py) takes a long silence for a hang and kills the engine."""
    done: list[int] = []
    body = {"prompt": "colour-03", "seed": 3, "num_inference_steps": 100, "num_outputs_per_prompt": 64}
    sent = time.monotonic()
    workers = [threading.Thread(target=lambda: done.append(_generate(engine_url, **body).status_code))
               for _ in range(3)]  # queued behind each other on the engine's one work thread: seconds of work
    for w in workers:
        w.start()
    probes = []  # (started after the requests, seconds to answer) while the rollouts run
    while any(w.is_alive() for w in workers):
        t0 = time.monotonic()
        assert requests.get(f"{engine_url}/health", timeout=5).status_code == 200
        probes.append((t0 - sent, time.monotonic() - t0))
    took = time.monotonic() - sent
    assert done == [200] * 3 and took > 1.5, took  # long enough for probes well inside it
    inside = [p for p in probes if 0.5 < p[0] < took - 0.5]
    assert inside and max(answer for _, answer in probes) < 0.5, (took, probes[:5], len(probes))
