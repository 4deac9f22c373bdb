"""Multi-LoRA on a Qwen3-MoE through the real trainer (`python -m kora_trainer.train`, Ray, the reference engine):
two adapters of different ranks with per-expert adapters on the fused experts and the router's adapter, pushed in
Adapter mode over the weight-update group. Every step's rollouts are served by the adapter at its own version as the
trainer holds it (engine-vs-trainer log-prob gap at fp32 rounding: an expert or router factor the engine missed
would leave a gap of its size), and each adapter ends Succeeded with an HF-PEFT export naming the experts and the
routers in `target_parameters`. (peft loading each export with kora's logits: tests/unit/test_multi_lora_moe_slots.py.)
The same job on the megatron backend at expert 2 (data 2: 2 rank actors, each its half of the experts; megatron's
MoE slots, tests/unit/test_megatron_multi_lora_moe.py): measured gap 3.6e-6, 90 s on the shared 2-core machine.
And that megatron job killed after both adapters' first checkpoints and started again from its job file: it resumes
each adapter from its own checkpoint and ends bit-identical to the same job run straight through (factors, AdamW
state and step counts, and the losses of every step after the restart): 130 to 180 s on the shared 2-core machine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from test_multi_lora import GAP_MAX, factors, job_file
from test_multi_lora_megatron import megatron_cpu_env

from kora_trainer.backends.megatron import megatron_available
from kora_trainer.checkpoint.adapter_slot import load_slot
from kora_trainer.toys.lm import write_dataset
from tinymodel import make_tiny_moe_model
from trainkit import TrainRun, wait_all

LORA = {"rank": 4, "alpha": 8, "syncMode": "Adapter",
        "targetModules": ["linear_qkv", "linear_fc1", "linear_fc2", "router"]}  # experts (fc1/fc2) and router
EXPERT2 = ("backend=megatron", "parallelism.data=2", "parallelism.expert=2")


def needs_megatron_cpu() -> None:
    if not megatron_available() or torch.cuda.is_available():
        pytest.skip("needs megatron-core on a machine without CUDA (the CPU stand-in; tests/gpu covers GPUs)")


def two_adapters(moe_dir: Path, steps: int) -> list[dict]:
    data = {"path": str(moe_dir / "train.parquet"), "rewardType": "custom",
            "customRewardPath": "toy_rewards.even_first_digit"}
    return [{"name": "odd", "rank": 4, "numSteps": steps},
            {"name": "even", "rank": 2, "numSteps": steps, "seed": 7, "data": data}]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    out = make_tiny_moe_model(tmp_path_factory.mktemp("moe") / "moe")
    write_dataset(out / "train.parquet")
    return out


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("backend", ["torch", "megatron-expert2"])
def test_two_moe_adapters_train_with_expert_and_router_adapters(moe_dir, tmp_path, backend):
    """On the torch backend, and on megatron at expert 2 (data 2: each rank actor its 4 of the 8 experts, megatron-core
    on the CPU in the rank actors: tests/megatron_cpu.py)."""
    if backend != "torch":
        needs_megatron_cpu()
    job = job_file(moe_dir, tmp_path, two_adapters(moe_dir, 2), lora=LORA)
    if backend == "torch":
        run = TrainRun(moe_dir, tmp_path, config=job)
    else:
        run = TrainRun(moe_dir, tmp_path, *EXPERT2, env=megatron_cpu_env(), config=job)
    wait_all([run], timeout_s=900)
    assert run.proc.returncode == 0, run.output[-3000:]
    summary = run.summary()["adapters"]
    steps = run.events("adapter_step")
    assert len(steps) == 4
    assert run.events("start")[0]["world"] == (1 if backend == "torch" else 2)
    print(f"{backend}: engine vs trainer gap at most {max(e['rollout_logp_gap_max'] for e in steps):.1e}")
    for e in steps:
        assert e["rollout_version_lag"] == 0 and e["rollout_logp_gap_max"] is not None, e
        assert e["rollout_logp_gap_max"] <= GAP_MAX, e
        assert e["sync"]["pushed"] and e["sync"]["adapter_version"] == e["step"], e
    for name, r in (("odd", 4), ("even", 2)):
        assert summary[name]["phase"] == "Succeeded" and summary[name]["steps"] == 2, summary
        export = tmp_path / "ckpt" / "adapters" / name / "lora_adapter"
        config = json.loads((export / "adapter_config.json").read_text())
        assert config["r"] == r and config["target_parameters"][:2] == ["mlp.experts.gate_up_proj",
                                                                         "mlp.experts.down_proj"]
        assert "model.layers.0.mlp.gate.weight" in config["target_parameters"]
        b = factors(tmp_path / "ckpt", name)["base_model.model.model.layers.0.mlp.experts.lora_B.weight"]
        assert b.shape[1] == r * 8 and b.abs().max() > 0, name  # per expert (8), at its own rank, trained


STEPS = 4  # checkpoints every 2 of an adapter's steps: killed after step 2's, it resumes at 2 and trains 3 and 4
SAME = ("loss", "grad_norm", "kl", "clip_frac", "reward_mean", "lr", "rollout_logp_gap_max")  # of each resumed step


def same_tensors(mine: dict, ref: dict) -> bool:
    return mine.keys() == ref.keys() and all(bool((mine[k] == ref[k]).all()) for k in ref)


@pytest.mark.slow
@pytest.mark.full
def test_a_killed_megatron_moe_job_resumes_both_adapters_bit_exactly(moe_dir, tmp_path):
    """Megatron at expert 2 (as above), async off (as tests/e2e/test_multi_lora_schedule.py: with async on, the step
    after a restart generates from a newer version): killed once both adapters have a checkpoint (the slot's expert
    factors and AdamW state gathered over the expert ranks, written once), the job started again from its job file
    (its checkpoint.path: adapters/registry.json and each adapter's checkpoint) ends as the job run straight."""
    needs_megatron_cpu()

    def start(work: Path, job: Path) -> TrainRun:
        return TrainRun(moe_dir, work, *EXPERT2, env=megatron_cpu_env(), config=job)

    straight = start(tmp_path / "straight", job_file(moe_dir, tmp_path / "straight", two_adapters(moe_dir, STEPS),
                                                     lora=LORA, checkpoint={"interval": 2}))
    wait_all([straight], timeout_s=900)  # one after the other: two Ray clusters of 2 megatron ranks overload 2 cores
    job = job_file(moe_dir, tmp_path / "crash", two_adapters(moe_dir, STEPS), lora=LORA, checkpoint={"interval": 2})
    first = start(tmp_path / "crash", job)
    deadline = time.monotonic() + 600
    while not {e["adapter"] for e in first.events("adapter_checkpoint")} >= {"odd", "even"}:
        assert first.running() and time.monotonic() < deadline, first.output[-3000:]
        time.sleep(0.1)
    first.kill()  # a crash: the registry file and the checkpoints are what is left
    again = start(tmp_path / "crash-2", job)
    wait_all([again], timeout_s=900)
    for run in (straight, again):
        assert {n: a["step"] for n, a in run.summary()["adapters"].items()} == {"odd": STEPS, "even": STEPS}
    resumed = {e["adapter"]: e["step"] for e in again.events("adapter_loaded")}
    assert set(resumed) == {"odd", "even"} and all(2 <= s < STEPS for s in resumed.values()), resumed
    ref = {(e["adapter"], e["step"]): e for e in straight.events("adapter_step")}
    after = again.events("adapter_step")
    assert sorted((e["adapter"], e["step"]) for e in after) == sorted(
        (n, s) for n, r in resumed.items() for s in range(r + 1, STEPS + 1))
    for e in after:
        assert {k: e[k] for k in SAME} == {k: ref[e["adapter"], e["step"]][k] for k in SAME}, e
    for name in ("odd", "even"):
        mine, theirs = factors(tmp_path / "crash" / "ckpt", name), factors(tmp_path / "straight" / "ckpt", name)
        assert same_tensors(mine, theirs), name
        for trained in ("mlp.experts.lora_B.weight", "mlp.gate.lora_B.weight"):  # the experts' and the router's
            assert any(k.endswith(trained) and mine[k].abs().max() > 0 for k in mine), (name, trained)
        (state, pos), (ref_state, ref_pos) = (load_slot(tmp_path / d / "ckpt", name) for d in ("crash", "straight"))
        assert state["step"] == ref_state["step"] == STEPS and pos == ref_pos, name
        opt, ref_opt = state["optimizer"]["state"], ref_state["optimizer"]["state"]
        assert opt.keys() == ref_opt.keys() and opt, name
        for k in ref_opt:  # AdamW: its step count and both moments, per parameter
            assert float(opt[k]["step"]) == float(ref_opt[k]["step"]) == STEPS, (name, k)
            assert same_tensors({m: v for m, v in opt[k].items() if m != "step"},
                                {m: v for m, v in ref_opt[k].items() if m != "step"}), (name, k)
