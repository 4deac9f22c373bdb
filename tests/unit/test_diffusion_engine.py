"""The reference diffusion engine as a real process on 127.0.0.1 (sglang-diffusion's `POST /rollout/generate`):
its rollouts, re-scored by the trainer in this process, give back every step's log-prob exactly; what it cannot
serve is a 400 that names the field, never a 5xx."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack
import pytest
import requests
import torch

from kora_trainer.diffusion import flow_grpo
from kora_trainer.diffusion.engine import decode_tensor, trajectory_from_responses
from kora_trainer.diffusion.policy import velocity_fn
from kora_trainer.diffusion.toy import load_diffusion_toy
from kora_trainer.wire.group import free_port
from localcluster import wait_for


@pytest.fixture(scope="module")
def engine_url(diffusion_toy_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("diffusion-engine") / "engine.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kora_trainer.diffusion.engine", "--toy", str(diffusion_toy_dir),
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


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "a cat"}, "prompt"),
    ({"prompt": "colour-01", "guidance_scale": 4.5}, "guidance_scale"),
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
