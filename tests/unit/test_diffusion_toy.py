"""The diffusion toy (`kora make-toy --diffusion`): written to disk, loaded back by diffusers' own from_pretrained,
and its built-in colour reward."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kora_trainer.algorithm.diffusion_rewards import colour_reward
from kora_trainer.toys.diffusion import TRANSFORMER, is_diffusion_toy, load_diffusion_toy


def test_the_parts_load_through_diffusers_from_pretrained(diffusion_toy_dir):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    transformer = SD3Transformer2DModel.from_pretrained(diffusion_toy_dir / "transformer")
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(diffusion_toy_dir / "scheduler")
    assert (transformer.config.in_channels, transformer.config.sample_size, transformer.config.patch_size) == (4, 8, 2)
    assert scheduler.config.shift == 3.0
    toy = load_diffusion_toy(diffusion_toy_dir)
    assert is_diffusion_toy(diffusion_toy_dir)
    assert toy.encoder_hidden_states.shape == (16, 4, TRANSFORMER["joint_attention_dim"])
    assert toy.pooled_projections.shape == (16, TRANSFORMER["pooled_projection_dim"])
    assert toy.targets.shape == (16, 4) and toy.latent_shape == (4, 8, 8)
    # the loaded weights are the saved ones: the same velocity from both loads, and a [B, 4, 8, 8] output
    x, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([1000.0, 500.0])
    with torch.no_grad():
        a = transformer(hidden_states=x, encoder_hidden_states=toy.encoder_hidden_states[:2],
                        pooled_projections=toy.pooled_projections[:2], timestep=t, return_dict=False)[0]
        b = toy.transformer(hidden_states=x, encoder_hidden_states=toy.encoder_hidden_states[:2],
                            pooled_projections=toy.pooled_projections[:2], timestep=t, return_dict=False)[0]
    assert a.shape == (2, 4, 8, 8) and torch.equal(a, b)
    # different prompts condition the model differently
    assert not torch.allclose(a[0], b[1])


def test_prompts_rows_are_ids_in_order_with_a_target_colour(diffusion_toy_dir):
    rows = [json.loads(line) for line in (diffusion_toy_dir / "prompts.jsonl").read_text().splitlines()]
    assert [r["prompt_id"] for r in rows] == list(range(16))
    assert all(len(r["target"]) == 4 and all(-0.5 <= v <= 0.5 for v in r["target"]) for r in rows)


def test_a_missing_toy_names_the_command_that_makes_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="kora make-toy --diffusion"):
        load_diffusion_toy(tmp_path)


def test_colour_reward_is_zero_on_target_and_falls_with_the_distance():
    target = torch.tensor([[0.2, -0.1, 0.0, 0.4]])
    on = target.view(1, 4, 1, 1).expand(1, 4, 8, 8).clone()
    on[:, :, 0, 0] += 1.0  # a bright pixel and a dark one: the mean colour is unchanged
    on[:, :, 0, 1] -= 1.0
    near, far = on + 0.1, on + 0.3
    r = colour_reward(torch.cat([on, near, far]), target.expand(3, 4))
    assert r[0].abs() < 1e-6
    assert torch.allclose(r[1:], torch.tensor([-0.1, -0.3]), atol=1e-6)
    with pytest.raises(ValueError, match="one target colour"):
        colour_reward(on, torch.zeros(1, 3))


def test_kora_make_toy_diffusion_writes_the_toy(tmp_path):
    out = tmp_path / "dtoy"
    proc = subprocess.run([sys.executable, "-m", "kora_cli.main", "make-toy", "--diffusion", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["kind"] == "diffusion-toy"
    assert is_diffusion_toy(out) and (out / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


def test_make_toy_diffusion_refuses_the_llm_toys_target(tmp_path):
    from kora_cli.main import main

    with pytest.raises(SystemExit, match="--target"):
        main(["make-toy", "--diffusion", "--target", "0.2", str(tmp_path / "other")])
    assert not (tmp_path / "other").exists()


def test_the_cli_makes_a_toy_of_another_latent_side_and_refuses_an_unknown_shape(tmp_path):
    """`kora make-toy --diffusion --sample-size 16`: a 16x16 latent the trainer and engine load as such (the GPU
    bench's SD3-medium shape is the same maker with another transformer config: 2B parameters, too big to write
    here); an unknown --diffusion-shape is refused by argparse naming the choices."""
    out = subprocess.run([sys.executable, "-m", "kora_cli.main", "make-toy", "--diffusion", "--sample-size", "16",
                          str(tmp_path / "toy16")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    toy = load_diffusion_toy(tmp_path / "toy16")
    assert toy.latent_shape == (4, 16, 16) and json.loads(out.stdout)["shape"] == "toy"
    bad = subprocess.run([sys.executable, "-m", "kora_cli.main", "make-toy", "--diffusion", "--diffusion-shape", "sd9",
                          str(tmp_path / "bad")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "sd3-medium" in bad.stderr
