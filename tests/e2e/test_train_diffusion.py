"""A diffusion job through the train command (issue 23): the diffusion toy (`kora make-toy --diffusion`) trained
with Flow-GRPO by `python -m kora_trainer.train --config trainer/examples/diffusion_toy.yaml`, its rollouts from the
reference diffusion engine beside the trainer, in both of the seed's LoRA sync modes.

- Every step's rollouts come from exactly the policy the trainer holds: the engine's per-step log-probs equal the
  trainer's re-score (the serving check's gap, < 1e-5 in fp32), and the two modes train the same curve — the mode
  changes what goes over the wire (A/B pairs for EngineMerge, the adapted weights folded for Merge), not the run.
- A run stopped after 2 steps and started again on its checkpoint.path resumes from step 2 and runs steps 3-4 with
  the uninterrupted run's losses and rewards exactly, ending on its adapter bit for bit; checkpoint.exportHF writes
  the adapter as diffusers' own LoRA file.
- The job's shape is checked before anything starts: a prompt the model's table lacks is refused naming data.path.
(The reward's rise is shown by tests/unit/test_diffusion_train.py -m slow; these runs are 4 steps.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainkit import REPO, TrainRun, hang_notice_s, wait_all

DIFFUSION_YAML = REPO / "trainer" / "examples" / "diffusion_toy.yaml"
STEPS = 4


def base(toy: Path) -> list[str]:
    """4 prompts x 4 images of 4 denoising steps a step: small, and still a group per prompt."""
    return [f"model.path={toy}", f"data.path={toy}/prompts.jsonl", "algorithm.rolloutBatchSize=4",
            "algorithm.nSamplesPerPrompt=4", "diffusion.numInferenceSteps=4"]


def run(toy: Path, work: Path, *overrides: str, env: dict[str, str] | None = None) -> TrainRun:
    # the control plane stays until a poll has read the final phase, as it does for the operator
    return TrainRun(toy, work, *overrides, config=DIFFUSION_YAML, base=base(toy),
                    env={"KORA_CONTROL_LINGER_S": "30", **(env or {})})


def curve(r: TrainRun) -> list[tuple[int, float, float]]:
    return [(e["step"], e["loss"], e["reward_mean"]) for e in r.events("step")]


def adapter(ckpt: Path, step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s adapter as the run held it (the file is in checkpoint.dtype)."""
    from kora_trainer.checkpoint import lora_only

    return lora_only.load_dir(ckpt / f"step_{step:08d}").adapter


@pytest.fixture(scope="module")
def uninterrupted(diffusion_toy_dir, tmp_path_factory):
    """EngineMerge, 4 steps, a checkpoint every step."""
    work = tmp_path_factory.mktemp("diffusion-engine-merge")
    r = run(diffusion_toy_dir, work, "lora.syncMode=EngineMerge", f"algorithm.numSteps={STEPS}",
            "checkpoint.interval=1", f"checkpoint.path={work / 'ckpt'}", "checkpoint.exportHF=true")
    wait_all([r])
    return r, work / "ckpt"


def test_both_modes_train_the_same_curve_and_the_engine_serves_every_pushed_policy(uninterrupted, diffusion_toy_dir,
                                                                                   tmp_path):
    engine_merge, _ = uninterrupted
    merge = run(diffusion_toy_dir, tmp_path, "lora.syncMode=Merge", f"algorithm.numSteps={STEPS}")
    wait_all([merge])
    for r, mode, what in ((engine_merge, "EngineMerge", "lora_pairs"), (merge, "Merge", "folded")):
        summary = r.summary()
        assert summary["sync_mode"] == mode and summary["steps"] == STEPS, summary
        steps = r.events("step")
        assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
        # the engine's log-probs of each step's images equal the trainer's re-score: it served the pushed policy
        assert all(e["rollout_logp_gap_max"] < 1e-5 for e in steps), [e["rollout_logp_gap_max"] for e in steps]
        assert {e["sync"]["what"] for e in steps} == {what} and all(e["sync"]["pushed"] for e in steps)
        final = r.seen[-1]
        assert final["phase"] == "Succeeded" and final["step"] == STEPS, final
        assert final["servingCheck"]["badSteps"] == 0
    pairs, folded = engine_merge.events("step")[0]["sync"], merge.events("step")[0]["sync"]
    # 15 adapted linears: the pairs are rank x (in + out) each, the folded weights in x out each
    assert pairs["bytes"] < folded["bytes"], (pairs, folded)
    want, got = curve(engine_merge), curve(merge)
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    for (_, loss_a, reward_a), (_, loss_b, reward_b) in zip(want, got, strict=True):
        assert abs(reward_a - reward_b) < 1e-5 and abs(loss_a - loss_b) < 1e-6, (want, got)
    assert want[-1][2] != want[0][2]  # it trained: the rewards moved
    # the export (checkpoint.exportHF): diffusers' LoRA file of the final adapter, 15 layers' A and B
    export = engine_merge.events("export")
    assert export and export[0]["step"] == STEPS, export
    exported = load_file(str(Path(export[0]["path"]) / "pytorch_lora_weights.safetensors"))
    assert len(exported) == 30 and all(k.startswith("transformer.transformer_blocks.") for k in exported)


def test_a_restarted_run_resumes_and_repeats_the_uninterrupted_steps_exactly(uninterrupted, diffusion_toy_dir,
                                                                             tmp_path):
    ref, ref_ckpt = uninterrupted
    ckpt = tmp_path / "ckpt"
    first = run(diffusion_toy_dir, tmp_path / "first", "lora.syncMode=EngineMerge", "algorithm.numSteps=2",
                "checkpoint.interval=1", f"checkpoint.path={ckpt}")
    wait_all([first])
    assert first.summary()["steps"] == 2
    second = run(diffusion_toy_dir, tmp_path / "second", "lora.syncMode=EngineMerge", f"algorithm.numSteps={STEPS}",
                 "checkpoint.interval=1", f"checkpoint.path={ckpt}")
    wait_all([second])
    summary = second.summary()
    assert summary["resumed_from_step"] == 2 and second.events("resume")[0]["step"] == 2
    assert curve(first) + curve(second) == curve(ref)  # every step, loss and reward, to the last bit
    want, got = adapter(ref_ckpt, STEPS), adapter(ckpt, STEPS)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_an_engine_hung_mid_rollout_fails_the_attempt_and_a_retry_resumes_exactly(uninterrupted, diffusion_toy_dir,
                                                                                 tmp_path):
    """The engine SIGSTOPs itself inside step 2's rollouts (its 6th /rollout/generate: 4 prompts a step;
    kora_engine/faults.py): the driver's hang watch kills it after rollout.engineHangSeconds and the attempt
    fails with EngineLost naming the engine, that it hung, its state, what the driver was doing and the fix; a retry
    on the same checkpoint.path resumes from step 1 and runs steps 2-4 as the uninterrupted run did."""
    from kora_engine.faults import HANG_AT_ENV

    ref, ref_ckpt = uninterrupted
    hang_s, ckpt = 4, tmp_path / "ckpt"
    job = ("lora.syncMode=EngineMerge", f"algorithm.numSteps={STEPS}", "checkpoint.interval=1",
           f"checkpoint.path={ckpt}", f"rollout.engineHangSeconds={hang_s}")
    hung = run(diffusion_toy_dir, tmp_path / "hung", *job, env={HANG_AT_ENV: "/rollout/generate:6:stop"})
    notice_s = hang_notice_s(hung, hung.run_dir / "engines" / "engine-0.log")
    msg = hung.seen[-1]["message"]
    assert hung.proc.returncode != 0 and notice_s < hang_s + 15, (notice_s, msg)
    for part in ("EngineLost", "engine 0 (pid", " hung: GET /health unanswered", "stopped (SIGSTOP)",
                 "step 2's rollouts", "step 1", "raise rollout.engineHangSeconds"):
        assert part in msg, (part, msg)
    retry = run(diffusion_toy_dir, tmp_path / "retry", *job)
    wait_all([retry])
    assert retry.summary()["resumed_from_step"] == 1
    assert curve(hung) + curve(retry) == curve(ref)  # every step, loss and reward, to the last bit
    want, got = adapter(ref_ckpt, STEPS), adapter(ckpt, STEPS)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_prompt_the_model_does_not_know_is_refused_naming_data_path(diffusion_toy_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a red fox", "target": [0.1, 0.2, 0.3, 0.4]}\n')
    r = run(diffusion_toy_dir, tmp_path, f"data.path={data}", "algorithm.numSteps=1")
    wait_all([r])
    assert r.proc.returncode != 0
    assert "data.path" in r.output and "a red fox" in r.output and "prompts.jsonl" in r.output, r.output[-2000:]
    assert r.seen and r.seen[-1]["phase"] == "Failed", r.seen[-1:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: the job would run on it")
def test_a_gpu_job_on_a_host_without_one_is_refused_naming_the_field(diffusion_toy_dir, tmp_path):
    r = run(diffusion_toy_dir, tmp_path, "rollout.gpusPerEngine=1", "algorithm.numSteps=1")
    wait_all([r])
    assert r.proc.returncode != 0
    assert "rollout.gpusPerEngine 1" in r.output and "no CUDA device" in r.output, r.output[-2000:]
    assert r.seen and r.seen[-1]["phase"] == "Failed", r.seen[-1:]


def test_a_guided_job_rolls_out_and_rescores_with_the_same_guidance(uninterrupted, diffusion_toy_dir, tmp_path):
    """diffusion.guidanceScale 4.5: the engine's guided steps are what the trainer re-scores (the serving check's
    gap stays at rounding; a trainer re-scoring without guidance would miss by > 1e-3, test_diffusion_engine.py),
    and the guidance changes the images: step 1's rewards are not the unguided run's."""
    guided = run(diffusion_toy_dir, tmp_path, "lora.syncMode=EngineMerge", "algorithm.numSteps=2",
                 "diffusion.guidanceScale=4.5")
    wait_all([guided])
    steps = guided.events("step")
    assert guided.proc.returncode == 0 and len(steps) == 2, guided.output[-2000:]
    assert all(e["rollout_logp_gap_max"] < 1e-5 for e in steps), [e["rollout_logp_gap_max"] for e in steps]
    unguided = uninterrupted[0].events("step")[0]
    assert abs(steps[0]["reward_mean"] - unguided["reward_mean"]) > 1e-4, (steps[0], unguided)
