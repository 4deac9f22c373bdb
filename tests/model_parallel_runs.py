"""The train command (`python -m kora_trainer.train`, backend megatron) split over 2 rank actors against the same job
in one process: tensor 2, pipeline 2, and on a tiny Qwen3-MoE expert 2 (carved out of data 2) and tensor 2 x
expert 2 (sequence parallel). Shared by tests/e2e/test_train_model_parallel_cpu.py (the CPU, megatron-core
through tests/megatron_cpu.py) and tests/gpu/test_train_model_parallel_gpu.py (a GPU a rank, NCCL: issue 22).

What a user would notice: the split job takes the one-process job's steps (its losses), the engines serve what the
ranks hold together after every push (the engine-vs-trainer log-prob gap of the sampled tokens), the PEFT export
is written, and the split job asked for more steps resumes from its own checkpoint and goes on.

Tolerances: fp32 toy; the TP all-reduces sum in another order than one rank's matmuls, and AdamW amplifies that
rounding over the steps (tests/gpu/test_megatron_tp.py measures the same on the policy alone: 1e-4 at the first
step, 2e-3 relative after), so losses are compared at 1e-5 + 2e-3 relative. On the CPU the gaps were
4.8e-7 (dense) and 4.5e-6 (MoE) and the losses within 6e-5 relative (2026-12-05).
"""

from __future__ import annotations

from pathlib import Path

from trainkit import TrainRun, wait_all

GAP_MAX = 1e-3
# the overrides of the job split over 2 ranks (the one-rank job keeps every size at 1)
SPLITS = {"tensor": ("parallelism.tensor=2",), "pipeline": ("parallelism.pipeline=2",),
          "expert": ("parallelism.data=2", "parallelism.expert=2"),  # expert parallelism: carved out of the data
          # MoE at tensor 2: sequence parallel, the experts carved out of the two TP ranks
          "moe-tensor-expert": ("parallelism.tensor=2", "parallelism.expert=2")}


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 + 2e-3 * abs(b)


def make_toys(root: Path) -> tuple[Path, Path]:
    """The toy (its dataset as train.jsonl) and a tiny Qwen3-MoE (4 layers, 8 experts top-2) with the toy's
    tokenizer, so the toy's prompts train it."""
    from kora_trainer.toys.lm import make_toy
    from tinymodel import make_tiny_moe_model

    make_toy(root / "toy", target=0.0, dataset="train.jsonl")
    return root / "toy", make_tiny_moe_model(root / "moe", vocab=16, layers=4)


def split_takes_the_steps_of_one(toy: Path, moe: Path, work: Path, split: str, mode: str, deployment: str,
                                 engines: int, *extra: str, steps: int, env: dict[str, str] | None = None,
                                 timeout_s: float = 600) -> list[dict]:
    """The job split by SPLITS[split] and the same job on one rank, at once; then the split job resumed for two
    more steps. `extra`: the machine's overrides (e.g. a GPU an engine). Returns the split run's start ranks."""
    model = (f"model.path={moe}",) if "expert" in split else ()
    common = (f"data.path={toy}/train.jsonl", "backend=megatron", f"deployment.mode={deployment}",
              "deployment.async=false", f"rollout.numEngines={engines}", f"lora.syncMode={mode}",
              "sync.deltaSkipThreshold=0", "checkpoint.interval=1", "checkpoint.exportHF=true", *model, *extra)
    runs = [TrainRun(toy, work / f"{split}{t}", *(SPLITS[split] if t == 2 else ()), f"checkpoint.path={work}/ckpt{t}",
                     f"algorithm.numSteps={steps}", *common, env=env) for t in (1, 2)]
    wait_all(runs, timeout_s=timeout_s)
    one, two = (r.summary() for r in runs)
    start = runs[1].events("start")[0]
    assert start["world"] == 2 and [r["rank"] for r in start["ranks"]] == [0, 1]
    assert two["transport"] == ("colocated" if deployment == "Colocate" else "distributed")
    assert len(two["loss_curve"]) == steps and any(x != 0.0 for x in one["loss_curve"])  # the reference trained
    assert all(close(b, a) for a, b in zip(one["loss_curve"], two["loss_curve"], strict=True)), \
        (one["loss_curve"], two["loss_curve"])
    gaps = [e["rollout_logp_gap_max"] for e in runs[1].events("step")]
    assert None not in gaps and max(gaps) < GAP_MAX, gaps  # the engines serve the split-trained policy
    assert two["export"] and (Path(two["export"]) / "adapter_model.safetensors").is_file(), two["export"]
    # resume: the same split job asked for two more steps continues from step `steps`' checkpoint
    more = TrainRun(toy, work / f"{split}2-more", *SPLITS[split], f"checkpoint.path={work}/ckpt2",
                    f"algorithm.numSteps={steps + 2}", *common, env=env)
    wait_all([more], timeout_s=timeout_s)
    tail = more.summary()
    assert tail["resumed_from_step"] == steps and len(tail["loss_curve"]) == 2
    assert max(e["rollout_logp_gap_max"] for e in more.events("step")) < GAP_MAX
    return list(start["ranks"])
