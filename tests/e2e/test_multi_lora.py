"""Multi-LoRA through the real trainer (`python -m kora_trainer.train`, Ray, the reference engine): several adapters
on one toy base, each with its own reward, rank, batch, optimizer and steps (SPEC "Multi-LoRA").

- Side by side: two adapters with different rewards train at once; each engine request is served by its own
  adapter at its own version (the engine-vs-trainer log-prob gap of every step stays at fp32 rounding), each push
  moves only the adapter that stepped (its own bytes: half for the rank-8 one), and each ends Succeeded at its
  numSteps with a PEFT export of its own rank.
- Independence: an adapter trained beside another ends equal to the same adapter trained alone (same seed,
  seeded rollouts, async off): EXACT (the factors compared bit for bit).
- Retire and reuse (service mode): DELETE /adapter_runs/a aborts its requests (0 in flight on the engine when it
  is unloaded), writes its checkpoint and export and frees its slot, which the next registration takes.
- The serving check per adapter: an engine that drops one adapter (and serves the other as trained) stops the job,
  naming that adapter on /status and in the message.
The learning curves (each adapter's reward rising by >= 0.4) are the full-size run: `make multi-lora-curves`.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from trainkit import TrainRun, hang_notice_s, wait_all

GAP_MAX = 1e-4  # fp32 engine vs trainer log-probs of the sampled tokens, as in the one-adapter tests


def job_file(toy_dir: Path, work: Path, adapters: list[dict], max_adapters: int = 2, **over: object) -> Path:
    data = str(toy_dir / "train.parquet")
    job = {
        "model": {"path": str(toy_dir)},
        "lora": {"rank": 16, "alpha": 32, "targetModules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                 "syncMode": "Adapter"},
        "algorithm": {"lr": 0.002, "rolloutBatchSize": 8, "nSamplesPerPrompt": 4, "globalBatchSize": 32,
                      "maxNewTokens": 4, "temperature": 1.0},
        "data": {"path": data, "inputKey": "prompt", "labelKey": "label"},
        "rollout": {"engine": "hf", "numEngines": 1, "gpusPerEngine": 0},
        "deployment": {"mode": "Disaggregated", "async": False},
        "sync": {"bufferSize": "256Ki"},
        "checkpoint": {"path": str(work / "ckpt"), "interval": 100},
        "multiLora": {"maxAdapters": max_adapters, "adapters": [
            {"data": {"path": data, "rewardType": "custom", "customRewardPath": "toy_rewards.odd_first_digit"}, **a}
            for a in adapters]},
    }
    for key, value in over.items():
        job[key] = {**job[key], **value} if isinstance(value, dict) else value  # type: ignore[dict-item]
    work.mkdir(parents=True, exist_ok=True)
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def factors(ckpt: Path, name: str) -> dict:
    return load_file(str(ckpt / "adapters" / name / "lora_adapter" / "adapter_model.safetensors"))


EVEN = {"path": None, "rewardType": "custom", "customRewardPath": "toy_rewards.even_first_digit"}


@pytest.mark.slow
def test_two_adapters_train_side_by_side_and_an_adapter_alone_ends_the_same(toy_dir, tmp_path):
    data = str(toy_dir / "train.parquet")
    a = {"name": "odd", "rank": 16, "numSteps": 4}
    b = {"name": "even", "rank": 8, "numSteps": 3, "seed": 7, "rolloutBatchSize": 16,
         "data": {**EVEN, "path": data}}
    both = TrainRun(toy_dir, tmp_path / "both", config=job_file(toy_dir, tmp_path / "both", [a, b]))
    alone = TrainRun(toy_dir, tmp_path / "alone", config=job_file(toy_dir, tmp_path / "alone", [a], max_adapters=1))
    wait_all([both, alone])
    summary = both.summary()["adapters"]
    assert summary["odd"]["phase"] == "Succeeded" and summary["odd"]["steps"] == 4
    assert summary["even"]["phase"] == "Succeeded" and summary["even"]["steps"] == 3
    steps = both.events("adapter_step")
    for e in steps:  # every rollout came from this adapter at its current version, served as the trainer holds it
        assert e["rollout_version_lag"] == 0 and e["rollout_logp_gap_max"] is not None
        assert e["rollout_logp_gap_max"] <= GAP_MAX, e
        assert e["sync"]["pushed"] and e["sync"]["adapter_version"] == e["step"], e
    # selective sync: a push moves the adapter that stepped, nothing else (rank 8 = half the bytes of rank 16)
    pushed = {name: {e["sync"]["bytes"] for e in steps if e["adapter"] == name} for name in ("odd", "even")}
    assert len(pushed["odd"]) == 1 and len(pushed["even"]) == 1
    assert pushed["even"].pop() * 2 == pushed["odd"].pop()
    loaded = {e["adapter"]: e for e in both.events("adapter_loaded")}
    assert loaded["even"]["rank"] == 8 and loaded["odd"]["sync"]["adapter_version"] == 0
    config = json.loads((tmp_path / "both" / "ckpt" / "adapters" / "even" / "lora_adapter" /
                         "adapter_config.json").read_text())
    assert config["r"] == 8
    # independence: exactly the adapter trained alone
    beside, by_itself = factors(tmp_path / "both" / "ckpt", "odd"), factors(tmp_path / "alone" / "ckpt", "odd")
    assert beside.keys() == by_itself.keys()
    moved = [k for k in beside if k.endswith("lora_B.weight") and beside[k].abs().max() > 0]
    assert moved, "the adapter never moved: the test would prove nothing"
    assert all(bool((beside[k] == by_itself[k]).all()) for k in beside)
    assert alone.summary()["adapters"]["odd"]["reward_curve"] == summary["odd"]["reward_curve"]


@pytest.mark.slow
@pytest.mark.full
def test_groups_stream_into_training_and_each_adapter_steps_when_its_batch_is_in(toy_dir, tmp_path):
    """Streaming (no exact-resume claim: no checkpoint.path, so each unit is its own engine call): an adapter's
    units come back as they are answered and train across several train calls (`train_calls`), its optimizer
    stepping once per batch with all of its samples, served as trained (tests/unit/test_multi_lora_stream.py
    shows units and the whole batch give the same update)."""
    data = str(toy_dir / "train.parquet")
    adapters = [{"name": "odd", "rank": 16, "numSteps": 3},
                {"name": "even", "rank": 8, "numSteps": 2, "seed": 7, "rolloutBatchSize": 16, "streamGroups": 4,
                 "data": {**EVEN, "path": data}}]
    run = TrainRun(toy_dir, tmp_path, config=job_file(toy_dir, tmp_path, adapters, checkpoint={"path": None}))
    wait_all([run])
    summary = run.summary()["adapters"]
    assert {n: (a["phase"], a["steps"]) for n, a in summary.items()} == {"odd": ("Succeeded", 3),
                                                                          "even": ("Succeeded", 2)}
    steps = run.events("adapter_step")
    assert {e["adapter"]: e["samples"] for e in steps} == {"odd": 32, "even": 64}
    assert [e["step"] for e in steps if e["adapter"] == "odd"] == [1, 2, 3]
    for e in steps:
        assert e["rollout_version_lag"] == 0 and e["rollout_logp_gap_max"] is not None
        assert e["rollout_logp_gap_max"] <= GAP_MAX, e
        assert 1 <= e["train_calls"] <= (8 if e["adapter"] == "odd" else 4), e
    assert max(e["train_calls"] for e in steps) > 1, "every batch came in one call: nothing streamed"


@pytest.mark.slow
@pytest.mark.full
def test_streamed_groups_with_async_generation_lag_one_version(toy_dir, tmp_path):
    """deployment.async with streaming: an adapter's next batch starts when the last unit of its current one is
    in, so its units come from one version behind; every batch still steps once, whole."""
    data = str(toy_dir / "train.parquet")
    adapters = [{"name": "odd", "rank": 16, "numSteps": 3},
                {"name": "even", "rank": 8, "numSteps": 2, "seed": 7, "streamGroups": 2,
                 "data": {**EVEN, "path": data}}]
    run = TrainRun(toy_dir, tmp_path, config=job_file(toy_dir, tmp_path, adapters, checkpoint={"path": None},
                                                      deployment={"async": True}))
    wait_all([run])
    summary = run.summary()["adapters"]
    assert {n: (a["phase"], a["steps"]) for n, a in summary.items()} == {"odd": ("Succeeded", 3),
                                                                          "even": ("Succeeded", 2)}
    steps = run.events("adapter_step")
    assert all(e["samples"] == 32 and e["rollout_version_lag"] <= 1 for e in steps), steps
    assert any(e["rollout_version_lag"] == 1 for e in steps)


@pytest.mark.slow
def test_colocated_adapters_are_served_as_trained(toy_dir, tmp_path):
    """Colocate: each adapter reaches the engine in memory (unload + load of its name, no version on that route):
    every step's rollouts are tagged with the adapter's own current version and served as the trainer holds it.
    No checkpoint.path (no exact-resume claim), so each batch streams as a call per group, units training as
    they come, each step taking its whole batch."""
    data = str(toy_dir / "train.parquet")
    adapters = [{"name": "odd", "rank": 16, "numSteps": 3},
                {"name": "even", "rank": 8, "numSteps": 3, "seed": 7, "data": {**EVEN, "path": data}}]
    run = TrainRun(toy_dir, tmp_path, config=job_file(toy_dir, tmp_path, adapters, checkpoint={"path": None},
                                                      deployment={"mode": "Colocate", "async": False}))
    wait_all([run])
    assert {n: a["steps"] for n, a in run.summary()["adapters"].items()} == {"odd": 3, "even": 3}
    steps = run.events("adapter_step")
    assert len(steps) == 6 and {e["sync"]["what"] for e in steps} == {"adapter"}
    assert all(e["samples"] == 32 and 1 <= e["train_calls"] <= 8 for e in steps), steps
    for e in steps:
        assert e["rollout_version_lag"] == 0 and e["rollout_logp_gap_max"] is not None, e
        assert e["rollout_logp_gap_max"] <= GAP_MAX, e


def api(run: TrainRun, method: str, path: str, body: object | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{run.port}{path}", data=data, method=method,
                                 headers={"Authorization": f"Bearer {run.token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, OSError):
        return 0, {}


def wait_state(run: TrainRun, name: str, done, timeout_s: float = 180.0) -> dict:
    """Bounded: GET /adapter_runs/{name} until `done(state)`."""
    deadline = time.monotonic() + timeout_s
    state: dict = {}
    while time.monotonic() < deadline:
        assert run.running(), run.output[-3000:]
        code, state = api(run, "GET", f"/adapter_runs/{name}")
        if code == 200 and done(state):
            return state
        time.sleep(0.2)
    pytest.fail(f"adapter {name} never reached the state asked for; last {state}\n{run.output[-2000:]}")


@pytest.mark.slow
def test_service_mode_registers_retires_and_reuses_a_slot(toy_dir, tmp_path):
    data = str(toy_dir / "train.parquet")
    run = TrainRun(toy_dir, tmp_path, "--time-limit", "400",
                   config=job_file(toy_dir, tmp_path, [], max_adapters=1))
    try:
        adapter = {"rank": 8, "numSteps": 1000,
                   "data": {"path": data, "rewardType": "custom", "customRewardPath": "toy_rewards.odd_first_digit"}}
        deadline = time.monotonic() + 120
        while (state := api(run, "GET", "/adapter_runs/state"))[0] != 200 and time.monotonic() < deadline:
            assert run.running(), run.output[-3000:]
            time.sleep(0.2)
        assert state[1]["active"] == 0  # a service starts idle
        code, a = api(run, "POST", "/adapter_runs", {"name": "a", "config": adapter})
        assert code == 201 and a["slot"] == 0, a
        code, full = api(run, "POST", "/adapter_runs", {"name": "b", "config": adapter})
        assert code == 409 and "no free slot" in full["error"]
        wait_state(run, "a", lambda s: s["phase"] == "Training" and s["step"] >= 2)
        code, retiring = api(run, "DELETE", "/adapter_runs/a")
        assert code == 202 and retiring["phase"] in ("Retiring", "Retired")
        done = wait_state(run, "a", lambda s: s["phase"] == "Retired")
        assert done["slot"] is None and done["exportPath"]
        assert (Path(done["exportPath"]) / "adapter_model.safetensors").is_file()
        retired = [e for e in run.events("adapter_retired") if e["adapter"] == "a"]
        assert retired and all(v == 0 for v in retired[0]["in_flight_left"].values()), retired
        code, b = api(run, "POST", "/adapter_runs", {"name": "b", "config": adapter})
        assert code == 201 and b["slot"] == 0  # a's slot
        wait_state(run, "b", lambda s: s["phase"] == "Training" and s["step"] >= 1)
        assert api(run, "GET", "/status")[1]["activeAdapters"] == 1
    finally:
        run.kill()


@pytest.mark.slow
def test_a_restarted_job_resumes_every_adapter_where_its_checkpoint_left_it(toy_dir, tmp_path):
    """Killed after an adapter's first checkpoint, the job started again brings back both adapters (slots, AdamW
    state, step, data position, RNG) and ends exactly where the uninterrupted job ends."""
    data = str(toy_dir / "train.parquet")
    adapters = [{"name": "odd", "rank": 16, "numSteps": 12},
                {"name": "even", "rank": 8, "numSteps": 12, "seed": 7, "data": {**EVEN, "path": data}}]
    over = {"checkpoint": {"interval": 3}}
    straight = TrainRun(toy_dir, tmp_path / "straight", config=job_file(toy_dir, tmp_path / "straight", adapters,
                                                                       **over))
    first = TrainRun(toy_dir, tmp_path / "crash", config=job_file(toy_dir, tmp_path / "crash", adapters, **over))
    deadline = time.monotonic() + 300
    while not {e["adapter"] for e in first.events("adapter_checkpoint")} >= {"odd", "even"}:
        assert first.running() and time.monotonic() < deadline, first.output[-3000:]
        time.sleep(0.1)
    first.kill()  # a crash: no goodbye, the registry file and the checkpoints are what is left
    saved = {e["adapter"]: e["step"] for e in first.events("adapter_checkpoint")}
    again = TrainRun(toy_dir, tmp_path / "crash-2", config=tmp_path / "crash" / "job.yaml")
    wait_all([straight, again])
    resumed = {e["adapter"]: e["step"] for e in again.events("adapter_loaded")}
    assert resumed and all(resumed[n] >= 3 and resumed[n] <= saved[n] + 3 for n in resumed), (resumed, saved)
    summary = again.summary()["adapters"]
    assert {n: a["step"] for n, a in summary.items()} == {"odd": 12, "even": 12}
    # each interval's checkpoint once: the retire at step 12 finds it written and does not write it again
    for name in ("odd", "even"):
        assert [e["step"] for e in straight.events("adapter_checkpoint") if e["adapter"] == name] == [3, 6, 9, 12]
    for name in ("odd", "even"):
        mine, ref = factors(tmp_path / "crash" / "ckpt", name), factors(tmp_path / "straight" / "ckpt", name)
        assert all(bool((mine[k] == ref[k]).all()) for k in ref), name


@pytest.mark.slow
def test_two_adapters_at_data_2_take_the_steps_of_data_1(toy_dir, tmp_path):
    """parallelism.data 2: each adapter's batches split over two rank actors, its gradients summed over them. The
    same job at data 1 is the reference: the same rewards (seeded rollouts of the same policy), losses and factors
    up to the order of fp32 sums (tests/e2e/test_train_data_parallel.py's tolerances), each adapter served as its
    ranks hold it."""
    data = str(toy_dir / "train.parquet")
    adapters = [{"name": "odd", "rank": 16, "numSteps": 3},
                {"name": "even", "rank": 8, "numSteps": 2, "seed": 7, "data": {**EVEN, "path": data}}]
    runs = {d: TrainRun(toy_dir, tmp_path / f"data{d}", f"parallelism.data={d}",
                        config=job_file(toy_dir, tmp_path / f"data{d}", adapters)) for d in (1, 2)}
    wait_all(list(runs.values()))
    one, two = (runs[d].summary()["adapters"] for d in (1, 2))
    assert runs[2].events("start")[0]["world"] == 2
    for name in ("odd", "even"):
        assert two[name]["phase"] == "Succeeded" and two[name]["reward_curve"] == one[name]["reward_curve"]
        losses = [[e["loss"] for e in runs[d].events("adapter_step") if e["adapter"] == name] for d in (1, 2)]
        assert max(abs(a - b) for a, b in zip(*losses, strict=True)) < 1e-6, losses
        ref, mine = factors(tmp_path / "data1" / "ckpt", name), factors(tmp_path / "data2" / "ckpt", name)
        assert max(float((ref[k] - mine[k]).abs().max()) for k in ref) < 2e-5, name
        gaps = [e["rollout_logp_gap_max"] for e in runs[2].events("adapter_step") if e["adapter"] == name]
        assert None not in gaps and max(gaps) <= GAP_MAX, gaps


@pytest.mark.slow
def test_an_adapter_the_engine_drops_stops_the_job_naming_it(toy_dir, tmp_path):
    """The serving check per adapter: the engine drops adapter `even` at every load (the reference engine's fault
    switch; it acknowledges each push and serves the base under even's version) while it serves `odd` as trained.
    even's gap is above sync.servedLogpGapMax from its second step (its first, B = 0, equals the base), odd's stays
    at fp32 rounding; after sync.servedBadStepsToFail bad steps of even the job stops Failed, /status's servingCheck
    and the message naming even, its version and the threshold."""
    from kora_engine.lm.adapter_registry import DROP_ADAPTER_ENV
    from kora_operator.api.job import LoRATrainingJob
    from kora_operator.progress import policy_served
    from specs import valid_job

    data = str(toy_dir / "train.parquet")
    adapters = [{"name": "odd", "rank": 16, "numSteps": 6},
                {"name": "even", "rank": 8, "numSteps": 6, "seed": 7, "data": {**EVEN, "path": data}}]
    job = job_file(toy_dir, tmp_path, adapters, sync={"bufferSize": "256Ki", "servedLogpGapMax": GAP_MAX,
                                                      "servedBadStepsToFail": 2, "deltaSkipThreshold": 0})
    run = TrainRun(toy_dir, tmp_path, config=job, env={DROP_ADAPTER_ENV: "even", "KORA_CONTROL_LINGER_S": "60"})
    wait_all([run])
    assert run.proc.returncode != 0, run.output[-3000:]
    final = run.seen[-1]
    assert final["phase"] == "Failed", final
    msg, check = final["message"], final["servingCheck"]
    assert "PolicyNotServed" in msg and "adapter even:" in msg and "sync.servedLogpGapMax 0.0001" in msg, msg
    assert check["adapter"] == "even" and check["badSteps"] == 2 and check["logpGapMax"] > GAP_MAX, check
    assert check["version"] == check["step"] - 1 and f"its policy version {check['version']}" in msg, msg
    steps = run.events("adapter_step")
    gaps = {name: [e["rollout_logp_gap_max"] for e in steps if e["adapter"] == name] for name in ("odd", "even")}
    assert gaps["odd"] and all(g <= GAP_MAX for g in gaps["odd"]), gaps  # served as trained beside the dropped one
    assert gaps["even"][0] <= GAP_MAX and all(g > GAP_MAX for g in gaps["even"][1:]), gaps
    assert len(gaps["even"]) == 3 and max(len(gaps["odd"]), len(gaps["even"])) < 6, gaps  # stopped early
    cond = policy_served(check, LoRATrainingJob.model_validate(valid_job("p")).spec)  # the operator's reading
    assert cond is not None and cond.status == "False" and "adapter even's version" in cond.message, cond


@pytest.mark.slow
def test_an_engine_hung_mid_generate_fails_the_job_naming_it(toy_dir, tmp_path):
    """The engine SIGSTOPs itself inside its third /generate (kora_engine/faults.py): the hang watch kills it
    after rollout.engineHangSeconds and the multi-adapter job fails with EngineLost naming the engine, that it hung
    and in what state, the round it was in and what a retry resumes from (each adapter's own checkpoint)."""
    from kora_engine.faults import HANG_AT_ENV

    hang_s = 5
    job = job_file(toy_dir, tmp_path, [{"name": "odd", "rank": 16, "numSteps": 6}],
                   rollout={"engineHangSeconds": hang_s})
    run = TrainRun(toy_dir, tmp_path, config=job, env={HANG_AT_ENV: "/generate:3:stop",
                                                        "KORA_CONTROL_LINGER_S": "60"})
    notice_s = hang_notice_s(run, run.run_dir / "logs" / "engine-0.log")
    msg = run.seen[-1]["message"]
    assert run.proc.returncode != 0 and notice_s < hang_s + 15, (notice_s, msg)
    for part in ("EngineLost", "engine 0 (pid", " hung: GET /health unanswered", "stopped (SIGSTOP)",
                 "a round of adapters odd", "each adapter from its own newest checkpoint"):
        assert part in msg, (part, msg)


@pytest.mark.slow
def test_a_job_that_can_start_none_of_its_adapters_fails_naming_why(toy_dir, tmp_path):
    """Each adapter's data lacks the prompt column (its rows cannot be read when it loads: that adapter fails and
    the job goes on without it); with every listed adapter failed the job has nothing to train and ends Failed,
    the message naming each and its error (the exception, not Ray's traceback), not Succeeded with nothing done."""
    bad = tmp_path / "no_prompt.jsonl"
    bad.write_text("".join(json.dumps({"question": f"{i}+1", "label": str(i + 1)}) + "\n" for i in range(8)))
    adapters = [{"name": "odd", "rank": 8, "numSteps": 2, "data": {**EVEN, "path": str(bad)}},
                {"name": "even", "rank": 4, "numSteps": 2, "data": {**EVEN, "path": str(bad)}}]
    run = TrainRun(toy_dir, tmp_path, config=job_file(toy_dir, tmp_path, adapters),
                   env={"KORA_CONTROL_LINGER_S": "60"})
    wait_all([run])
    msg = run.seen[-1]["message"]
    assert run.proc.returncode != 0 and run.seen[-1]["phase"] == "Failed", run.output[-3000:]
    assert "every adapter of multiLora.adapters failed" in msg and "Traceback" not in msg, msg
    for name in ("odd", "even"):
        assert f"{name}: could not start: ValueError: data.path {bad}: rows lack ['prompt']" in msg, msg
