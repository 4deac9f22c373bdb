"""`kora plan FILE` and `python -m kora_trainer.train --dry-run`: the placement, started nothing (config/placement.py
is pure). Every shipped sample plans, with a world of data x tensor x pipeline x context ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kora_trainer.config import ConfigError, load_config
from kora_trainer.config.placement import Node, assign, parse_nodes, plan_job, plan_placement

REPO = Path(__file__).resolve().parents[2]
SAMPLES = sorted((REPO / "manifests" / "samples").glob("*.yaml"))
TOY = REPO / "trainer" / "examples" / "toy.yaml"


def cfg(*overrides: str):
    return load_config(TOY, ["model.path=/nonexistent", *overrides])[0]


def kora(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kora_cli.main", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_every_sample_plans_with_its_whole_world(sample):
    out = kora("plan", "--json", str(sample))
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    p = yaml.safe_load(sample.read_text())["spec"].get("parallelism", {})
    world = p.get("data", 1) * p.get("tensor", 1) * p.get("pipeline", 1) * p.get("context", 1)
    assert plan["world"] == world == len(plan["ranks"])
    assert [r["coords"]["rank"] for r in plan["ranks"]] == list(range(world))
    # no GPU is given twice, and a rank's tensor-parallel group is on one node
    taken = [(r["node"], g) for r in plan["ranks"] for g in r["gpus"]]
    if plan["transport"] == "distributed":
        taken += [(e["node"], g) for e in plan["engines"] for g in e["gpus"]]
    assert len(taken) == len(set(taken))
    groups: dict[tuple, set] = {}
    for r in plan["ranks"]:
        c = r["coords"]
        groups.setdefault((c["dp"], c["pp"], c["cp"]), set()).add(r["node"])
    assert all(len(nodes) == 1 for nodes in groups.values())


def test_the_two_worker_moe_sample_puts_the_ranks_on_one_worker_and_the_engines_on_the_other():
    plan = json.loads(kora("plan", "--json", str(REPO / "manifests/samples/moe-adapter-mode.yaml")).stdout)
    assert {r["node"] for r in plan["ranks"]} == {"worker-0"} and {e["node"] for e in plan["engines"]} == {"worker-1"}
    assert [e["gpus"] for e in plan["engines"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r["coords"]["ep"] for r in plan["ranks"]] == [0, 1, 2, 3, 0, 1, 2, 3]  # expert 4 carved out of 8 ranks
    assert len(plan["weight_update_group"]) == 1 + 2 * 4  # rank 0 and every engine TP rank
    assert all(e["address"] != "127.0.0.1" for e in plan["engines"])  # the group spans nodes: node addresses


def test_colocate_puts_each_engine_on_its_ranks_gpu_and_a_cpu_job_stays_on_loopback():
    plan = plan_job(cfg("parallelism.data=4", "rollout.numEngines=4", "deployment.mode=Colocate",
                        "rollout.gpusPerEngine=1"), parse_nodes("1x4"))
    assert [(e.fed_by, e.gpus) for e in plan.engines] == [(i, [i]) for i in range(4)]
    assert plan.transport == "colocated" and plan.weight_update_group == []
    cpu = plan_job(cfg("parallelism.data=2", "rollout.numEngines=2"), [Node("local", 2, 0)])
    assert {e.address for e in cpu.engines} == {"127.0.0.1"} and cpu.weight_update_group[0] == "trainer rank 0"


def test_pack_spreads_what_one_node_cannot_hold_and_refuses_what_no_node_can():
    placement = plan_placement(cfg("parallelism.data=2", "deployment.mode=Colocate", "rollout.numEngines=2",
                                   "rollout.gpusPerEngine=0"), 0)
    assert [node for node, _ in assign(placement, [Node("a", 1.0, 0), Node("b", 1.0, 0)])] == ["a", "b"]
    assert [node for node, _ in assign(placement, [Node("a", 2.0, 0), Node("b", 2.0, 0)])] == ["a", "a"]
    with pytest.raises(ConfigError, match=r"fits on none of the nodes"):
        assign(placement, [Node("a", 0.5, 0)])
    with pytest.raises(ConfigError, match=r"needs 9 GPUs .* Ray cluster has 8"):
        plan_job(cfg("parallelism.data=8", "deployment.mode=Disaggregated", "rollout.gpusPerEngine=1"),
                 parse_nodes("1x8"))
    with pytest.raises(ConfigError, match=r"--nodes 'eight': write NODESxGPUS"):
        parse_nodes("eight")


def test_train_dry_run_prints_the_plan_and_names_the_fix_for_a_layout_it_would_refuse():
    base = [sys.executable, "-m", "kora_trainer.train", "--config", str(TOY), "--dry-run", "model.path=/nonexistent"]
    ok = subprocess.run([*base, "parallelism.data=2", "--json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["world"] == 2
    refused = subprocess.run([*base, "parallelism.tensor=2"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "needs backend: megatron" in refused.stderr


# A sample the trainer would stop at start plans (where it would run) and says it would not start: the plan's
# start_refusals, printed as "REFUSED at start by the trainer". Every shipped sample starts now (the last refused,
# moe-adapter-mode.yaml's tensor 2 x expert 4, trains since MoE layers run under sequence parallelism).
REFUSED_AT_START: dict[str, str] = {}


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_every_sample_plan_says_whether_the_trainer_would_start_it(sample):
    plan = json.loads(kora("plan", "--json", str(sample)).stdout)
    expected = REFUSED_AT_START.get(sample.name)
    if expected is None:
        assert plan["start_refusals"] == [], plan["start_refusals"]
    else:
        assert len(plan["start_refusals"]) == 1 and expected in plan["start_refusals"][0]
        assert "REFUSED at start by the trainer" in kora("plan", str(sample)).stdout
        assert yaml.safe_load(sample.read_text())["spec"]["parallelism"]["expert"] > 1


def test_the_vl_samples_start_checks_pass_on_a_tiny_model_of_their_architecture(tmp_path):
    """The Qwen3.6 samples against a real config.json of their architecture (the MoE VL toy's
    Qwen3_5MoeConfig, vision_config and all): every rule passes, the VL model is kept off megatron, the layout
    starts on torch; the same sample in Adapter mode with scope all is refused by SPEC rule 4, read from it."""
    from kora_operator.validation import validate_job
    from kora_trainer.backends.select import check_actor_layout, resolve_backend
    from kora_trainer.toys.vl import moe_model_config

    moe_model_config().save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "qwen3_5_moe" and hf["vision_config"]
    for name in ("vl-merge-mode.yaml", "qwen36-moe-vl-adapter-mode.yaml"):
        doc = yaml.safe_load((REPO / "manifests" / "samples" / name).read_text())
        doc["spec"]["model"] = {"path": str(tmp_path)}
        job, problems = validate_job(doc)
        assert job is not None and [p for p in problems if p.severity == "error"] == [], (name, problems)
        backend = resolve_backend(job.spec, cuda=True, megatron=True, model_bytes=70 << 30,
                                  model_type=hf["model_type"], vision=True)
        assert backend.value == "torch"
        check_actor_layout(job.spec, backend)
        doc["spec"]["lora"] = {**doc["spec"]["lora"], "syncMode": "Adapter", "scope": "all"}
        _, problems = validate_job(doc)
        assert [p.rule for p in problems] == ["adapter-vision-scope"], (name, problems)
        assert f"{tmp_path}/config.json declares vision_config" in problems[0].message
