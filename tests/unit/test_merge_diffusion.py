"""`kora merge` of a diffusion job's export (diffusers' LoRA file) into the diffusion toy's pipeline directory: the
merged transformer, loaded by diffusers' own `from_pretrained`, gives the adapted transformer's velocities; the
pipeline's other parts come along unchanged; a wrong base is refused before anything is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kora_trainer.checkpoint.diffusers_export import export_diffusers_lora, lora_config
from kora_trainer.checkpoint.peft_adapter import AdapterError
from kora_trainer.lora.diffusers import SD3_TARGETS, apply_diffusion_lora
from kora_trainer.lora.model import adapter_parameters
from kora_trainer.toys.diffusion import load_diffusion_toy


def _velocity(transformer, toy, x):
    return transformer(hidden_states=x, encoder_hidden_states=toy.encoder_hidden_states[:2],
                       pooled_projections=toy.pooled_projections[:2], timestep=torch.tensor([900.0, 300.0]),
                       return_dict=False)[0]


@pytest.fixture
def exported(diffusion_toy_dir, tmp_path):
    """The toy's transformer with a trained-looking adapter (B moved off zero), exported as a diffusion job does."""
    toy = load_diffusion_toy(diffusion_toy_dir)
    torch.manual_seed(0)
    apply_diffusion_lora(toy.transformer, rank=4, alpha=8, targets=SD3_TARGETS, init="gaussian")
    with torch.no_grad():
        for p in adapter_parameters(toy.transformer):
            p.add_(torch.randn_like(p) * 0.05)
    export_diffusers_lora(tmp_path / "ckpt", toy.transformer, lora_config(4, 8, SD3_TARGETS, "gaussian"), {"step": 1})
    return toy, tmp_path / "ckpt" / "lora_adapter"


def test_the_merged_pipeline_loads_with_diffusers_and_gives_the_adapted_policy(diffusion_toy_dir, exported,
                                                                               tmp_path):
    from diffusers import SD3Transformer2DModel

    toy, adapter = exported
    out = tmp_path / "merged"
    kora = Path(sys.executable).with_name("kora")  # the command a user runs
    proc = subprocess.run([str(kora), "merge", "--base", str(diffusion_toy_dir), "--adapter", str(adapter), "--out",
                           str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "merged 15 adapter pairs" in proc.stdout  # the toy's 15 adapted modules (test_diffusion_lora.py)
    merged = SD3Transformer2DModel.from_pretrained(out / "transformer").eval()
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = _velocity(toy.transformer, toy, x), _velocity(merged, toy, x)
        base = _velocity(load_diffusion_toy(diffusion_toy_dir).transformer, toy, x)
    assert (want - base).abs().max() > 1e-3  # the adapter moves the policy, so equality below means something
    assert (got - want).abs().max() < 1e-5  # fp32 fold, rounded once
    for part in ("scheduler/scheduler_config.json", "prompt_embeds.safetensors", "prompts.jsonl", "toy.json",
                 "transformer/config.json"):
        assert (out / part).read_bytes() == (diffusion_toy_dir / part).read_bytes(), part


def test_the_transformer_directory_itself_is_a_base_too(diffusion_toy_dir, exported, tmp_path):
    from kora_trainer.checkpoint.merge import merge

    report = merge(diffusion_toy_dir / "transformer", exported[1], tmp_path / "t", progress=False)
    assert report.folded == 15 and (tmp_path / "t" / "diffusion_pytorch_model.safetensors").exists()


def test_an_adapter_of_another_model_is_refused_before_anything_is_written(exported, toy_dir, tmp_path):
    from kora_trainer.checkpoint.merge import merge

    with pytest.raises(AdapterError, match="has no base partner"):
        merge(toy_dir, exported[1], tmp_path / "wrong", progress=False)
    assert not (tmp_path / "wrong").exists()
