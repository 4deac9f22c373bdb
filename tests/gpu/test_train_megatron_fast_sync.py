"""`python -m kora_trainer.train` with `backend: megatron` and weight sync on the fast path (sync/fast/distributed.py):
the toy, Disaggregated (trainer on GPU 0, the reference engine on GPU 1, one NCCL weight-update group),
on-policy steps. The first sync is the HTTP path's and plans the fast one; every step's push is then a fast push
(Merge: `plan.PipelinedSender` into the engine's `PipelinedReceiver`; Adapter: `adapter_pack.AdapterPack` into its
`AdapterRing`). The same job with `sync.fastPath=false` gives the HTTP path's numbers beside it.

What says the push is right: `rollout_logp_gap_max` (trainer vs engine log-probs of the sampled tokens before
each step's first update; fp32 on both sides), bound 1e-3 as in test_train_megatron.py, whose fixtures and
settings this reuses.

Run: bash hack/gpu_env.sh /tmp/mc; PYTHONPATH=$PWD/trainer:$PWD/engine:$PWD/tests:/tmp/mc NCCL_NVLS_ENABLE=0 \
    KORA_MEGATRON_REPORT=$OUT/report.jsonl python3 -m pytest -q -s tests/gpu/test_train_megatron_fast_sync.py
"""

from __future__ import annotations

import pytest
from test_megatron_model import report
from test_train_megatron import GAP_BOUND, MEGATRON, data, toy  # noqa: F401 (toy: that module's fixture)

from gpukit import megatron_marks
from trainkit import TrainRun, wait_all

pytestmark = megatron_marks(gpus=2, timeout=900)
DISAGGREGATED = ["deployment.mode=Disaggregated", "algorithm.numSteps=4"]


@pytest.mark.parametrize("mode", ["Merge", "Adapter"])
def test_megatron_fast_path_pushes_every_step_and_the_engine_serves_the_policy(toy, tmp_path, mode):  # noqa: F811
    # buckets that hold the largest folded weight (TINY has 256Ki; the plan refuses a weight split over buckets)
    common = [data(toy), *MEGATRON, f"lora.syncMode={mode}", *DISAGGREGATED, "sync.bufferSize=1Mi"]
    fast = TrainRun(toy, tmp_path / "fast", *common)
    wait_all([fast], poll=False)
    http = TrainRun(toy, tmp_path / "http", *common, "sync.fastPath=false")  # one at a time: 2 GPUs
    wait_all([http], poll=False)
    summary, baseline = fast.summary(), http.summary()
    assert summary["backend"] == "MegatronBackend" and summary["transport"] == "distributed", fast.output[-2000:]
    assert any(n.startswith("fast path on") for n in fast.notes()), fast.output[-3000:]
    paths = summary["sync_paths"]
    assert set(paths) == {"fast"} and paths["fast"]["pushes"] == 4, paths
    assert set(baseline["sync_paths"]) == {"http"}
    for s in (summary, baseline):
        gap = s["rollout_logp_gap_max"]
        assert gap is not None and gap < GAP_BOUND, f"engine vs megatron policy log-probs differ by {gap}"
    assert len(set(summary["loss_curve"])) > 1
    row = dict(test="train_megatron_fast_sync", mode=mode, fast_ms_p50=paths["fast"]["ms_p50"],
               http_ms_p50=baseline["sync_paths"]["http"]["ms_p50"], bytes_per_step=summary["sync_bytes_per_step"],
               logp_gap_max=summary["rollout_logp_gap_max"], http_logp_gap_max=baseline["rollout_logp_gap_max"],
               wall_s=summary["wall_s"], http_wall_s=baseline["wall_s"])
    report(**row)  # printed, and appended to $KORA_MEGATRON_REPORT
