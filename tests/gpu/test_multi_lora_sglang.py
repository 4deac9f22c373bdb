"""Multi-LoRA served by real SGLang (issues 43 item 5 and 44): the multi-adapter recipe (`python -m
kora_trainer.train`, backend megatron) with two adapters of different ranks on the toy base, Colocate, one SGLang
0.5.17 engine on one GPU serving both (`lora_path` per request, each publish an unload + load of that name through
`/load_lora_adapter_from_tensors`).

What it shows: both adapters reach their numSteps (Succeeded), every step of each is served-checked (the engine's
log-probs of the sampled tokens against the trainer's, per adapter), each push carries only the adapter that
stepped (the rank-4 one half the rank-8 one's bytes), and every request the trainer sent SGLang after its start was
answered 2xx.

Run on the device: `MODES=... bash hack/gpu_sglang_toy.sh` runs tests/gpu/test_train_sglang.py; this module:
`source hack/gpu_sglang_env.sh && python -m pytest -m sglang tests/gpu/test_multi_lora_sglang.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from test_megatron_model import report
from test_train_sglang import SGLANG_ARGS, engine_calls
from test_train_sglang import pytestmark as pytestmark  # the same GPU and SGLang 0.5.17 gates

from trainkit import TrainRun, wait_all

STEPS = int(os.environ.get("KORA_SGLANG_TEST_STEPS", "6"))


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    from kora_trainer.toys.lm import make_toy

    out = tmp_path_factory.mktemp("toy") / "toy"
    make_toy(out, dataset="train.jsonl")
    return out


def job_file(toy: Path, work: Path) -> Path:
    data = {"path": str(toy / "train.jsonl"), "rewardType": "math"}
    job = {
        "model": {"path": str(toy)}, "backend": "megatron",
        "lora": {"rank": 8, "alpha": 16, "targetModules": ["linear_qkv", "linear_proj"], "syncMode": "Adapter"},
        "algorithm": {"lr": 0.002, "rolloutBatchSize": 8, "nSamplesPerPrompt": 4, "globalBatchSize": 32,
                      "maxNewTokens": 4, "temperature": 1.0},
        "data": {"path": str(toy / "train.jsonl"), "inputKey": "prompt", "labelKey": "label"},
        "rollout": {"engine": "sglang", "sglangBuild": "0.5.17", "numEngines": 1, "gpusPerEngine": 1,
                    "sglangArgs": yaml.safe_load(SGLANG_ARGS)},
        "deployment": {"mode": "Colocate", "async": False},
        "multiLora": {"maxAdapters": 2, "adapters": [
            {"name": "big", "rank": 8, "numSteps": STEPS, "data": data},
            {"name": "small", "rank": 4, "alpha": 8, "numSteps": STEPS, "seed": 7, "data": data}]},
    }
    work.mkdir(parents=True, exist_ok=True)
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_two_adapters_on_megatron_are_served_by_real_sglang_each_step(toy, tmp_path):
    run = TrainRun(toy, tmp_path, config=job_file(toy, tmp_path / "job"), base=[])  # the job file has every path
    wait_all([run], timeout_s=850)
    steps = run.events("adapter_step")
    (tmp_path / "adapter_steps.json").write_text(json.dumps(steps))  # first: kept should an assertion fail
    assert {n: a["steps"] for n, a in run.summary()["adapters"].items()} == {"big": STEPS, "small": STEPS}
    gaps = {n: [e["rollout_logp_gap_max"] for e in steps if e["adapter"] == n] for n in ("big", "small")}
    assert all(len(g) == STEPS and None not in g for g in gaps.values()), gaps
    bound = run.summary().get("served_logp_gap_max_bound", 0.25)
    assert max(max(g) for g in gaps.values()) < bound, gaps
    pushed = {n: {e["sync"]["bytes"] for e in steps if e["adapter"] == n} for n in ("big", "small")}
    assert pushed["small"] == {b // 2 for b in pushed["big"]}, pushed
    calls = engine_calls(run)
    bad = [c for c in calls if not 200 <= c[2] < 300]
    report(test="multi_lora_sglang", steps=STEPS, gaps=gaps, pushed={n: sorted(b) for n, b in pushed.items()},
           routes=sorted({r for _, r, _ in calls}),
           bad=bad[:5])
    assert calls and not bad, f"SGLang answered {len(bad)} of {len(calls)} requests with an error: {bad[:5]}"
