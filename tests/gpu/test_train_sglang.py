"""The trainer with real SGLang (issue 43): `python -m kora_trainer.train` on one GPU with `rollout.engine: sglang`,
`rollout.sglangBuild: "0.5.17"`, Colocate (trainer and engine share the GPU), in Merge and Adapter mode on the
toy's own recipe (trainer/examples/toy.yaml: its addition reward, cosine schedule).

What it shows, per mode: every step ran and was checked (PolicyServed: the engine's log-probs of the sampled
tokens against the trainer's, `sync.servedLogpGapMax`), the reward rose (the last 10 steps' mean over the first
10's), every request the trainer sent SGLang was answered 2xx (SGLang's access log), and the sync took the HTTP
route the build table names. The per-step gaps go to the report (tests/gpu/test_megatron_model.report) for the
threshold study in docs/sglang_builds.md.

Run on the device: `source hack/gpu_sglang_env.sh && python -m pytest -m sglang tests/gpu/test_train_sglang.py`
(hack/sglang_carry.sh makes the carried tarball). Skipped where there is no GPU or SGLang 0.5.17 is not importable.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from importlib import metadata
from pathlib import Path

import pytest
import torch
from test_megatron_model import report

from trainkit import TrainRun, wait_all


def _sglang_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(_sglang_version() != "0.5.17", reason="needs sglang 0.5.17 (hack/gpu_sglang_env.sh)"),
]
STEPS = int(os.environ.get("KORA_SGLANG_TEST_STEPS", "100"))  # ~1.3 s a toy step on an H100 (Merge)
# the kernels the carried SGLang has (hack/sglang_carry.sh drops FA3 and flashinfer's JIT sources); no CUDA graphs:
# the test pays SGLang's start, not its peak speed (bench/gpu_train.py --engine sglang measures that)
SGLANG_ARGS = ("[--attention-backend,triton,--sampling-backend,pytorch,--lora-backend,triton,--disable-cuda-graph,"
               "--mem-fraction-static,'0.3']")
ACCESS = re.compile(r'"(GET|POST) (/[^ ?"]*)[^"]*" (\d{3})')


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    from kora_trainer.toys.lm import make_toy

    out = tmp_path_factory.mktemp("toy") / "toy"
    make_toy(out, dataset="train.jsonl")  # pretrained to the toy's target accuracy: the reward can rise from there
    return out


def engine_calls(run: TrainRun) -> list[tuple[str, str, int]]:
    """(method, route, status) of every request SGLang's HTTP server logged, less its start-up /health 503s: until
    it is ready it answers the trainer's readiness probes 503 by design (233 of them in the first H100 run; the
    trainer's /model_info and first /generate may come before any /health 200)."""
    logs = sorted((run.run_dir / "logs").glob("engine-*.log"))
    assert logs, f"no engine log under {run.run_dir / 'logs'}"
    out = []
    for log in logs:
        calls = [(m, r, int(s)) for m, r, s in ACCESS.findall(log.read_text(errors="replace"))]
        first_generate = next((i for i, c in enumerate(calls) if c[1] == "/generate"), len(calls))
        out += [c for i, c in enumerate(calls) if not (i < first_generate and c[1] == "/health" and c[2] == 503)]
    return out


@pytest.mark.parametrize("mode", ["Merge", "Adapter"])
def test_real_sglang_serves_the_policy_every_step_and_the_reward_rises(toy, tmp_path, mode):
    overrides = ["rollout.engine=sglang", "rollout.sglangBuild=0.5.17", f"rollout.sglangArgs={SGLANG_ARGS}",
                 "rollout.gpusPerEngine=1", "deployment.mode=Colocate", "deployment.async=false",
                 f"lora.syncMode={mode}", f"algorithm.numSteps={STEPS}"]
    run = TrainRun(toy, tmp_path, *overrides, base=[f"model.path={toy}", f"data.path={toy}/train.jsonl"])
    wait_all([run], timeout_s=850)
    summary = run.summary()
    steps = run.events("step")
    # the curves first, so a failed assertion below still leaves them for the report
    (run.run_dir.parent / f"curve-{mode}.json").write_text(json.dumps({
        "reward": [s["reward_mean"] for s in steps], "gap": [s.get("rollout_logp_gap_max") for s in steps],
        "stale_gap": [s.get("stale_logp_gap_max") for s in steps], "sync_ms": [s["sync"].get("ms") for s in steps]}))
    assert summary["steps"] == STEPS == len(steps)
    assert summary["transport"] == "colocated" and set(summary["sync_paths"]) == {"http"}, summary["sync_paths"]
    gaps = [s["rollout_logp_gap_max"] for s in steps if s.get("rollout_logp_gap_max") is not None]
    assert len(gaps) == STEPS, "the serving check must run on every step"
    bound = summary.get("served_logp_gap_max_bound", 0.25)
    assert max(gaps) < bound, f"PolicyServed broke: engine vs trainer log-prob gap {max(gaps)} >= {bound}"
    # the serving check's resolution: what an engine one push behind would have shown at each step
    stale = sorted(s["stale_logp_gap_max"] for s in steps if s.get("stale_logp_gap_max") is not None)
    rewards = [s["reward_mean"] for s in steps]
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    calls = engine_calls(run)
    bad = [c for c in calls if not 200 <= c[2] < 300]
    assert calls and not bad, f"SGLang answered {len(bad)} of {len(calls)} requests with an error: {bad[:5]}"
    report(test="train_sglang", mode=mode, steps=STEPS, reward_first10=round(first, 4), reward_last10=round(last, 4),
           gap_mean=statistics.mean(gaps), gap_p99=sorted(gaps)[max(0, round(0.99 * len(gaps)) - 1)],
           gap_max=max(gaps), stale_gap_min=stale[0] if stale else None,
           stale_gap_p50=statistics.median(stale) if stale else None, sync_ms_p50=summary["sync_ms_p50"],
           wall_s=summary["wall_s"],
           routes=sorted({r for _, r, _ in calls}), notes=run.notes()[:2])
    assert last > first, f"the reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
