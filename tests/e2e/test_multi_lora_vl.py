"""Multi-LoRA on the vision-language toy (`kora make-toy --vl`) through the real trainer: two adapters whose data
name an image column (`multiLora.adapters[].data.imageKey`) roll out image prompts under their own names — each
request carries its row's image as `image_data`, the placeholders expanded as in a one-adapter VL job — and the
trainer scores them with the images (the engine-vs-trainer gap stays at fp32 rounding). The images are read: the
toy names a colour only from its image, and both adapters' sampled rewards sit near the pretrained toy's sampled
accuracy (0.36; a prompt without its image is at chance, 1 in 8)."""

from __future__ import annotations

import statistics

import pytest
from test_multi_lora import GAP_MAX, job_file

from trainkit import TrainRun, wait_all


@pytest.mark.slow
def test_two_adapters_roll_out_their_image_prompts_and_train_on_them(vl_toy_dir, tmp_path):
    data = {"path": str(vl_toy_dir / "train.parquet"), "inputKey": "prompt", "labelKey": "label",
            "imageKey": "image", "rewardType": "math"}
    adapters = [{"name": "left", "rank": 8, "numSteps": 2, "data": data},
                {"name": "right", "rank": 4, "numSteps": 2, "seed": 7, "data": data}]
    job = job_file(vl_toy_dir, tmp_path, adapters, lora={"rank": 8, "alpha": 16, "scope": "language"},
                   algorithm={"maxNewTokens": 2, "lr": 0.003})
    r = TrainRun(vl_toy_dir, tmp_path, config=job)
    wait_all([r])
    assert r.proc.returncode == 0, r.output[-3000:]
    summary = r.summary()["adapters"]
    steps = r.events("adapter_step")
    for name in ("left", "right"):
        assert summary[name]["phase"] == "Succeeded" and summary[name]["steps"] == 2, summary
        mine = [e for e in steps if e["adapter"] == name]
        assert all(e["rollout_logp_gap_max"] is not None and e["rollout_logp_gap_max"] <= GAP_MAX for e in mine), mine
        assert statistics.fmean(e["reward_mean"] for e in mine) > 0.25, [e["reward_mean"] for e in mine]
