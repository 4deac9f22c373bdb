"""The diffusion job's pieces the Flow-GRPO recipe stands on (recipes/flow_grpo.py): the fields as Flow-GRPO's knobs,
which rows a step takes, the rewards, and the refusals of a model or data the path cannot take."""

from __future__ import annotations

import sys

import pytest
import torch

from kora_trainer.config import TrainerConfig
from kora_trainer.recipes.flow_grpo import (
    DiffusionJobError,
    load_model,
    load_prompts,
    reward_of,
    settings_of,
    step_rows,
)


def job(toy, data=None, **diffusion) -> TrainerConfig:
    return TrainerConfig.model_validate({
        "model": {"path": str(toy)}, "lora": {"rank": 8, "alpha": 16, "syncMode": "EngineMerge"},
        "algorithm": {"rolloutBatchSize": 4, "nSamplesPerPrompt": 4, "globalBatchSize": 8, "lr": 0.01, "seed": 3},
        "data": {"path": str(toy / "prompts.jsonl"), "labelKey": "target", **(data or {})},
        "rollout": {"engine": "hf"},
        "diffusion": {"kind": "image", "numInferenceSteps": 5, **diffusion}})


def test_the_jobs_fields_become_the_loops_knobs(diffusion_toy_dir):
    s = settings_of(job(diffusion_toy_dir, noiseLevel=0.5, clipEps=2e-4))
    assert (s.prompts_per_step, s.samples_per_prompt, s.minibatches) == (4, 4, 2)  # 16 samples in batches of 8
    assert (s.num_inference_steps, s.noise_level, s.clip_eps, s.lora_rank, s.lora_alpha, s.seed) == (
        5, 0.5, 2e-4, 8, 16, 3)


def test_a_steps_rows_are_a_function_of_seed_and_step():
    assert torch.equal(step_rows(3, 7, 16, 8), step_rows(3, 7, 16, 8))  # a resumed run takes the same rows
    assert not torch.equal(step_rows(3, 7, 16, 8), step_rows(3, 8, 16, 8))
    assert step_rows(3, 7, 16, 8).unique().numel() == 8  # a permutation's prefix: no prompt twice
    many = step_rows(3, 7, 5, 12)  # more rows than the data holds: every row, twice, then part of a third pass
    assert many.numel() == 12 and torch.bincount(many, minlength=5).min() >= 2


def test_the_colour_reward_reads_each_rows_target_and_a_custom_one_is_called_by_its_path(diffusion_toy_dir,
                                                                                         tmp_path, monkeypatch):
    cfg = job(diffusion_toy_dir)
    toy = load_model(cfg)
    prompts = load_prompts(cfg, toy)
    assert len(prompts.labels[0]) == 4 and prompts.ids.tolist() == list(range(len(toy.prompts)))
    rows = torch.tensor([2, 2, 5])
    images = toy.targets[rows][:, :, None, None].expand(3, 4, 8, 8).clone()  # each the colour its prompt asks
    assert torch.allclose(reward_of(cfg, prompts, 4)(images, rows), torch.zeros(3), atol=1e-6)
    (tmp_path / "my_scores.py").write_text(
        "import torch\n"
        "def brightness(images, prompts, labels):\n"
        "    assert len(prompts) == len(labels) == images.shape[0]\n"
        "    return images.mean(dim=(1, 2, 3))\n"
        "def wrong_shape(images, prompts, labels):\n"
        "    return torch.zeros(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = job(diffusion_toy_dir, {"customRewardPath": "my_scores.brightness"}, reward="custom")
    assert torch.allclose(reward_of(custom, prompts, 4)(images, rows), images.mean(dim=(1, 2, 3)))
    custom = job(diffusion_toy_dir, {"customRewardPath": "my_scores.wrong_shape"}, reward="custom")
    with pytest.raises(DiffusionJobError, match=r"data.customRewardPath my_scores.wrong_shape returned shape \(2, 2\)"):
        reward_of(custom, prompts, 4)(images, rows)
    sys.modules.pop("my_scores", None)


def test_a_model_or_data_the_path_cannot_take_is_refused_naming_the_field(diffusion_toy_dir, toy_dir, tmp_path):
    with pytest.raises(DiffusionJobError, match=r"model.path .* is not a diffusion checkpoint.*--make-toy"):
        load_model(job(toy_dir))  # the language-model toy
    with pytest.raises(DiffusionJobError, match=r"diffusion.resolution 64: the model makes 8x8 images.*set "
                                                r"diffusion.resolution to 8"):
        load_model(job(diffusion_toy_dir, resolution=64))
    cfg = job(diffusion_toy_dir, {"labelKey": "prompt"})
    with pytest.raises(DiffusionJobError, match=r"data.labelKey prompt: diffusion.reward colour needs .* 4 numbers"):
        reward_of(cfg, load_prompts(cfg, load_model(cfg)), 4)


def test_the_export_is_diffusers_own_lora_file_and_loads_into_the_trained_policy(diffusion_toy_dir, tmp_path):
    """diffusers' `load_lora_adapter` (what an SD3 pipeline's `load_lora_weights` calls for its transformer) reads
    the export into a fresh transformer that computes exactly what the trainer's adapted one does."""
    from kora_trainer.checkpoint.diffusers_export import WEIGHT_NAME, export_diffusers_lora, lora_config
    from kora_trainer.lora.diffusers import SD3_TARGETS, apply_diffusion_lora
    from kora_trainer.lora.model import lora_modules
    from kora_trainer.toys.diffusion import load_diffusion_toy
    from kora_trainer.toys.diffusion_policy import velocity_fn

    trained, fresh, base = (load_diffusion_toy(diffusion_toy_dir) for _ in range(3))
    torch.manual_seed(0)
    apply_diffusion_lora(trained.transformer, 4, 8.0, SD3_TARGETS)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B off zero: the adapter changes the output
        for m in lora_modules(trained.transformer).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
    out = export_diffusers_lora(tmp_path, trained.transformer, lora_config(4, 8.0, SD3_TARGETS, "gaussian"),
                                {"step": 3})
    assert sorted(p.name for p in out.iterdir()) == ["kora_lora_meta.json", WEIGHT_NAME]
    fresh.transformer.load_lora_adapter(str(out), weight_name=WEIGHT_NAME, adapter_name="kora")
    ids, x, t = torch.tensor([0, 3]), torch.randn(2, 4, 8, 8), torch.tensor([500.0, 500.0])
    with torch.no_grad():
        want, got, plain = (velocity_fn(toy, ids)(x, t) for toy in (trained, fresh, base))
    assert float((want - plain).abs().max()) > 1e-2  # the adapter matters
    assert torch.equal(want, got)


def test_tracking_kl_to_base_measures_the_kl_without_adding_it_to_the_loss(diffusion_toy_dir):
    """tracking.klToBase on a diffusion job: the step's KL to the adapter-off base is computed (B moved, so it is
    > 0) and the loss is the one without it."""
    from dataclasses import replace

    from kora_trainer.algorithm import flow_grpo
    from kora_trainer.backends.diffusion.train_loop import local_rollout, update
    from kora_trainer.lora.diffusers import apply_diffusion_lora
    from kora_trainer.lora.model import adapter_parameters, lora_modules

    cfg = TrainerConfig.model_validate({**job(diffusion_toy_dir).model_dump(by_alias=True),
                                        "tracking": {"klToBase": True}})
    s = settings_of(cfg)
    assert s.measure_kl and s.kl_coef == 0

    def one_pass(settings):
        toy = load_model(cfg)
        torch.manual_seed(0)
        apply_diffusion_lora(toy.transformer, 4, 8.0)
        with torch.no_grad():
            for m in lora_modules(toy.transformer).values():
                m.lora_B.weight.fill_(0.01)
        ids = torch.arange(4).repeat_interleave(4)
        traj = local_rollout(settings)(toy, ids, 0)
        adv = flow_grpo.advantages(torch.arange(16.0), 4)
        opt = torch.optim.SGD(adapter_parameters(toy.transformer), lr=0.0)
        return update(toy, settings, traj, ids, adv, opt)

    measured, plain = one_pass(s), one_pass(replace(s, measure_kl=False))
    assert measured["kl"] > 0 and plain["kl"] == 0 and measured["loss"] == plain["loss"]


def test_timestep_fraction_trains_the_first_steps_only(diffusion_toy_dir):
    """diffusion.timestepFraction 0.4 of 5 steps: the update is the one of the trajectory cut after its first 2
    steps (flow_grpo's int(T x fraction)), bit for bit, and not the whole trajectory's."""
    from dataclasses import replace

    from kora_trainer.algorithm import flow_grpo
    from kora_trainer.backends.diffusion.train_loop import local_rollout, trained_steps, update
    from kora_trainer.lora.diffusers import apply_diffusion_lora
    from kora_trainer.lora.model import adapter_parameters, adapter_tensors

    s = settings_of(job(diffusion_toy_dir, timestepFraction=0.4))
    assert s.timestep_fraction == 0.4 and trained_steps(5, 0.4) == 2 and trained_steps(5, 0.01) == 1

    def adapter_after(settings, cut=None):
        toy = load_model(job(diffusion_toy_dir))
        torch.manual_seed(0)
        apply_diffusion_lora(toy.transformer, 4, 8.0)
        ids = torch.arange(4).repeat_interleave(4)
        traj = local_rollout(replace(settings, timestep_fraction=1.0))(toy, ids, 0)
        if cut is not None:
            traj = flow_grpo.Trajectory(latents=traj.latents[:, :cut + 1], log_probs=traj.log_probs[:, :cut],
                                        timesteps=traj.timesteps[:cut], sigmas=traj.sigmas[:cut + 1],
                                        noise_level=traj.noise_level)
        opt = torch.optim.SGD(adapter_parameters(toy.transformer), lr=0.1)
        update(toy, settings, traj, ids, flow_grpo.advantages(torch.arange(16.0), 4), opt)
        return dict(adapter_tensors(toy.transformer))

    part, cut, whole = adapter_after(s), adapter_after(replace(s, timestep_fraction=1.0), cut=2), \
        adapter_after(replace(s, timestep_fraction=1.0))
    assert all(torch.equal(part[k], cut[k]) for k in part)
    assert not all(torch.equal(part[k], whole[k]) for k in part)
