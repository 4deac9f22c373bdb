"""Multi-LoRA on the megatron backend on a Qwen3-MoE (backends/megatron/multi_lora.py): adapter slots on the experts'
linears (one (A, B) per expert, as the single-adapter megatron path wraps them) and on the routers, on the CPU twins
(megatron-core's real layers and process groups over gloo: tests/megatron_cpu.py).

What a user relies on:
- Independence: two adapters (ranks 4 and 2, their own seeds, rewards and learning rates) trained side by side; the
  first ends bit-identical to it trained alone (every step's metrics too), each moving its expert and router factors.
- The torch backend's MoE slots (lora/slots.py: PEFT's grouped expert layout, the router's plain pair) on the same
  base, from the same init and on the same batches report the same losses (TORCH_LOSS absolute, KL and grad norms
  TORCH_REL relative) and end with the same adapters (TORCH_ATOL). No fused-linear caveat here: an expert's
  linear_fc1 [gate_e; up_e] has one A, as transformers 5's fused gate_up_proj has in PEFT's grouped layout; the
  targets leave out linear_qkv (one A for q, k and v on megatron, one per projection on torch) and the model has no
  dense MLP layer (its linear_fc1 would be the same fused case).
- The HF-PEFT export of each slot (target_parameters on the experts and routers, as the torch slots write it) loads
  in peft with logits equal to the megatron slot's (TOL).
- Split over ranks (`full`): expert 2 (data 2: each rank its 2 of the 4 experts), expert 2 x data 4 (the slot's AdamW
  state split over the 2 ranks holding the same experts), tensor 2 and tensor 2 x expert 2 (sequence parallelism),
  pipeline 2 and pipeline 2 x expert 2:
  the same init, the same training as in one process (loss / KL / grad norm SPLIT_REL relative, adapters and the
  gathered checkpoint state SPLIT_ATOL; the checkpoint under the one-process names), independence bit for bit there
  too, and the one-process checkpoint resumes there (each rank its own experts and shards, exactly).
- The engines serve what the slots hold (`full`): after each push from an expert-2 policy (rank 0 holding the
  colocated transport, the other following; each slot's experts gathered from both ranks) the reference engine asked
  for that adapter by name gives the trainer's log-probs (ATOL), an unpushed slot keeping its served version.

Tiny model: 2 layers, both MoE, hidden 64, 4 experts top-2, moe_intermediate 16, vocab 16; fp32, 3 steps.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_megatron_multi_lora import (
    METRICS,
    PROMPTS,
    RESPONSES,
    REWARDS,
    _max_diff,
    _rel,
    serve_two_slots,
    settings,
    train,
)

from engine_helpers import ATOL, load_hf, served_engine
from kora_trainer.backends.megatron import megatron_available
from kora_trainer.wire.ports import free_port
from megatron_cpu import run_ranks
from tinymodel import make_tiny_moe_model

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not megatron_available(), reason="needs megatron-core (the test group installs it)"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for CUDA; tests/gpu covers GPUs")]

TARGETS = ["linear_proj", "linear_fc1", "linear_fc2", "router"]
EXPERTS = 4
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4], [1, 6, 2, 8, 13, 14, 12, 5]])
TOL = 1e-5  # logits, fp32 (as tests/unit/test_multi_lora_moe_slots.py)
# measured (docs/multi_lora.md), 3 steps, one process: the torch slots vs megatron's, losses within 3.0e-8 (absolute:
# the first step's is 0 by construction), KL and grad norms 1.0e-6 relative, adapters 2.5e-5 — all but a few elements
# of the experts' factors within 1e-6; those few (4 of the 1024 in one layer's down_proj B) belong to an expert that
# saw few tokens: a near-zero gradient summed in another order, which AdamW turns into a share of an lr-sized step
TORCH_LOSS, TORCH_REL, TORCH_ATOL = 1e-5, 1e-4, 1e-4
# split over ranks vs one process (`full`), measured: loss, KL and grad norm within 5.6e-6 relative at expert 2 (data
# 2), 7.5e-6 at expert 2 x data 4, 3.7e-5 at tensor 2 (sequence parallelism's sums in another order); adapters within
# 1.1e-5, 4.1e-6, and 1.9e-4 at tensor 2 and tensor 2 x expert 2 — there on the same few elements of one layer's
# down_proj B as against the torch slots (an expert that saw few tokens; AdamW). clip_frac, a per-micro-batch mean
# weighted by the micro-batch's share, follows how data > 1 cuts the minibatch into micro-batches: not compared.
# Pipeline 2: 2.6e-7 / 2.5e-7; pipeline 2 x expert 2: 5.6e-6 / 6.0e-6.
SUMMED = ("loss", "kl", "grad_norm")
SPLIT_REL, SPLIT_ATOL = 1e-4, 1e-3


def _cfg(model_dir: str, layout: tuple[int, ...] = (1, 1, 1, 1), backend: str = "megatron"):
    from kora_trainer.config import load_config

    tensor, pipeline, data, expert = layout
    overrides = [f"model.path={model_dir}", "data.path=unused.parquet", "lora.rank=4", "lora.alpha=8",
                 "lora.syncMode=Adapter", "rollout.engine=hf", "algorithm.lr=0.01", "algorithm.klCoef=0.05",
                 "algorithm.rolloutBatchSize=2", "algorithm.nSamplesPerPrompt=4", f"parallelism.tensor={tensor}",
                 f"parallelism.pipeline={pipeline}", f"parallelism.data={data}", f"parallelism.expert={expert}",
                 f"backend={backend}", "multiLora.maxAdapters=2"]
    cfg, _ = load_config(None, overrides, base={"lora": {"rank": 4, "targetModules": TARGETS}})
    return cfg


def _logits(mg) -> torch.Tensor:
    """The policy's logits [B, L, V] on IDS (tensor 1, one stage)."""
    pos = torch.arange(IDS.shape[1]).unsqueeze(0).expand_as(IDS)
    with torch.no_grad():
        return mg.model(IDS, pos, None).detach().clone()


def run_rank(rank: int, world: int, port: int, model_dir: str, out: str, layout: list[int], resume: str = "") -> None:
    """One rank of `layout` (tensor, pipeline, data, expert): adapters a and b beside each other, then a alone;
    `resume`: a saved run whose a's state (the checkpoint's) is loaded into a fresh slot at the end."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from kora_trainer.backends.megatron.backend import MegatronBackend
    from kora_trainer.backends.megatron.multi_lora import MegatronMultiLoRATrainer
    from kora_trainer.backends.megatron.parallel import destroy_parallel

    mg = MegatronBackend(_cfg(model_dir, tuple(layout)), dtype=torch.float32, micro_batch_size=3)
    beside = MegatronMultiLoRATrainer(mg)
    for n in ("a", "b"):
        beside.add(settings(n))
    run: dict = {"init": {n: dict(beside.adapter_named(n)) for n in ("a", "b")}}
    run["steps"] = train(beside, ["a", "b"])
    run["after"] = {n: dict(beside.adapter_named(n)) for n in ("a", "b")}
    run["config"] = {n: beside.peft_config(n) for n in ("a", "b")}
    run["state"] = beside.state("a")
    a = beside.adapters["a"]
    run["adam"] = (sum(v.numel() for st in a.optimizer.state.values() for k, v in st.items() if k == "exp_avg"),
                   sum(p.numel() for p in a.slot.params))
    if world == 1:
        run["logits"] = {}
        for n in ("a", "b"):
            with beside.active(n):
                run["logits"][n] = _logits(mg)
    for n in ("a", "b"):
        beside.remove(n)
    alone = MegatronMultiLoRATrainer(mg)
    alone.add(settings("a"))
    run["alone"] = train(alone, ["a"])
    run["alone_after"] = dict(alone.adapter_named("a"))
    if resume:
        alone.remove("a")
        alone.add(settings("a"))
        alone.load_state("a", torch.load(resume, weights_only=False)["state"])
        run["resumed"] = (dict(alone.adapter_named("a")), alone.state("a"))
    torch.save(run, f"{out}.{rank}")
    destroy_parallel()


def _run(root: Path, model_dir: Path, layout: tuple[int, int, int, int], name: str, resume: str = "") -> list[dict]:
    out = root / name / "res.pt"
    out.parent.mkdir()
    world = layout[0] * layout[1] * layout[2]
    run_ranks("test_megatron_multi_lora_moe", "run_rank", world, free_port(), str(model_dir), str(out), list(layout),
              resume)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlora-moe")


@pytest.fixture(scope="module")
def moe(root) -> Path:
    return make_tiny_moe_model(root / "moe", layers=2, experts=EXPERTS, moe_intermediate=16, dense_layers=())


@pytest.fixture(scope="module")
def one(root, moe) -> dict:
    return _run(root, moe, (1, 1, 1, 1), "one")[0]


def check_slots(ranks: list[dict]) -> None:
    """Independence (bit for bit), every rank alike, expert and router factors moved, each slot its own rank."""
    run = ranks[0]
    for r in ranks[1:]:
        assert r["steps"] == run["steps"]
        assert _max_diff(r["after"]["a"], run["after"]["a"]) == 0.0  # every rank exports the whole adapter alike
    assert [s["a"] for s in run["steps"]] == [s["a"] for s in run["alone"]]
    assert _max_diff(run["after"]["a"], run["alone_after"]) == 0.0
    experts = "base_model.model.model.layers.0.mlp.experts"
    for n, r in (("a", 4), ("b", 2)):
        after = run["after"][n]
        assert tuple(after[f"{experts}.base_layer.lora_A.weight"].shape) == (EXPERTS * r, 64)  # gate_up_proj
        assert tuple(after[f"{experts}.lora_B.weight"].shape) == (64, r * EXPERTS)  # down_proj
        for key in (f"{experts}.base_layer.lora_B.weight", f"{experts}.lora_B.weight",
                    "base_model.model.model.layers.1.mlp.gate.lora_B.weight"):
            assert after[key].abs().max() > 0, f"{n}: {key} never moved"
    assert all(s[n]["loss"] != 0.0 for s in run["steps"][1:] for n in ("a", "b"))


def torch_run(model_dir: Path, init: dict, steps: list[dict]) -> tuple[list[dict], dict]:
    """The torch backend's MoE slots on the same base from megatron's init, on megatron's batches."""
    from kora_trainer.backends.batch import RolloutBatch
    from kora_trainer.backends.multi_lora import MultiLoRATrainer
    from kora_trainer.backends.torch_backend import TorchBackend

    trainer = MultiLoRATrainer(TorchBackend(_cfg(str(model_dir), backend="torch"), micro_batch_size=3, threads=1))
    for n in ("a", "b"):
        trainer.add(settings(n))
        named = dict(trainer.adapter_named(n))
        assert set(named) == set(init[n])  # the same HF-PEFT names and shapes
        with torch.no_grad():
            for name, t in named.items():
                t.copy_(init[n][name])
    got = []
    for step in steps:
        batches = {n: RolloutBatch(PROMPTS, RESPONSES, step[n]["logp"], REWARDS[n], 4,
                                   ["0"] * len(PROMPTS)) for n in ("a", "b")}
        got.append({m.name: {k: getattr(m, k) for k in METRICS} for m in trainer.train(batches)})
    return got, {n: {k: t.clone() for k, t in trainer.adapter_named(n)} for n in ("a", "b")}


def test_moe_slots_at_one_process_train_independently_as_the_torch_slots_and_export_to_peft(one, moe, tmp_path):
    from peft import PeftModel

    from kora_trainer.checkpoint.peft_export import export_peft

    check_slots([one])
    got, after = torch_run(moe, one["init"], one["steps"])
    losses = max(abs(g[n]["loss"] - w[n]["loss"]) for g, w in zip(got, one["steps"], strict=True) for n in "ab")
    rel = max(_rel(g[n][k], w[n][k]) for g, w in zip(got, one["steps"], strict=True) for n in "ab"
              for k in ("kl", "grad_norm"))
    adapters = max(_max_diff(after[n], one["after"][n]) for n in "ab")
    print(f"torch vs megatron MoE slots: losses within {losses:.1e}, KL and grad norms {rel:.1e} relative, "
          f"adapters {adapters:.1e}")
    assert losses < TORCH_LOSS and rel < TORCH_REL and adapters < TORCH_ATOL
    worst = 0.0
    plain = load_hf(moe)
    with torch.no_grad():
        base = plain(IDS).logits
    for n, r in (("a", 4), ("b", 2)):
        config = one["config"][n]
        assert config["r"] == r and config["target_parameters"] == [
            "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "model.layers.0.mlp.gate.weight",
            "model.layers.1.mlp.gate.weight"]
        out = export_peft(tmp_path / n, one["after"][n], config, {})
        peft = PeftModel.from_pretrained(load_hf(moe), str(out)).eval()
        with torch.no_grad():
            theirs = peft(IDS).logits
        assert (one["logits"][n] - base).abs().max() > 1e-3  # the trained adapter moves the logits
        worst = max(worst, float((theirs - one["logits"][n]).abs().max()))
    print(f"peft vs megatron slot logits: {worst:.1e}")
    assert worst < TOL


# (tensor, pipeline, data, expert), over how many ranks a slot's AdamW state is split (its expert-data-parallel group
# at tensor 1; at tensor 2 under sequence parallelism that group holds the TP peers: whole)
SPLITS = {"expert2": ((1, 1, 2, 2), 1), "expert2-data4": ((1, 1, 4, 2), 2), "tensor2": ((2, 1, 1, 1), 1),
          "tensor2-expert2": ((2, 1, 2, 2), 1), "pipeline2": ((1, 2, 1, 1), 1),
          "pipeline2-expert2": ((1, 2, 2, 2), 1)}


@pytest.mark.full
@pytest.mark.parametrize("split", list(SPLITS))
def test_moe_slots_split_over_ranks_train_as_in_one_process(root, moe, one, split):
    layout, adam_split = SPLITS[split]
    ranks = _run(root, moe, layout, split, resume=str(root / "one" / "res.pt.0"))
    check_slots(ranks)
    got = ranks[0]
    metrics, adapters = 0.0, 0.0
    for n in ("a", "b"):
        assert _max_diff(got["init"][n], one["init"][n]) == 0.0  # the same init whatever the split
        adapters = max(adapters, _max_diff(got["after"][n], one["after"][n]))
        for g, w in zip(got["steps"], one["steps"], strict=True):
            metrics = max(metrics, *(_rel(g[n][k], w[n][k]) for k in SUMMED))
    for rank, r in enumerate(ranks):  # expert-data-parallel rank: megatron orders the expert ranks innermost
        held, factors = r["adam"]
        share = -(-factors // adam_split)
        assert held == min(share, factors - rank // (len(ranks) // adam_split) * share), (rank, held, factors)
    # the checkpoint state: the one-process names (rank 0's, then the other rank's experts: resumed by name)
    adapters = max(adapters, _max_diff(got["state"]["tensors"], one["state"]["tensors"]))
    for r in ranks:  # the one-process checkpoint resumes here: each rank takes its own experts back out
        resumed, state = r["resumed"]
        assert _max_diff(resumed, one["after"]["a"]) == 0.0
        assert _max_diff(state["tensors"], one["state"]["tensors"]) == 0.0
    print(f"{split} vs one process: metrics {metrics:.1e} relative, adapters {adapters:.1e}")
    assert metrics < SPLIT_REL and adapters < SPLIT_ATOL



def sync_rank(rank: int, world: int, port: int, model_dir: str, out: str, url: str, layout: list[int]) -> None:
    """One rank of a 2-rank expert-parallel policy with slots a and b (rank 0 holds the colocated transport): the
    base pushed once, each adapter by name (its expert factors gathered from both ranks); a trained and pushed, then
    b."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from kora_trainer.backends.megatron.backend import MegatronBackend

    mg = MegatronBackend(_cfg(model_dir, tuple(layout)), dtype=torch.float32, micro_batch_size=3)
    serve_two_slots(mg, rank, url, out)


@pytest.mark.full  # an engine and two ranks
def test_engines_serve_each_moe_slot_as_two_expert_parallel_ranks_hold_it(root, moe, tmp_path):
    out = tmp_path / "sync.pt"
    with served_engine(moe, tmp_path, "--max-lora-rank", "4", "--max-loras-per-batch", "2") as (engine, _):
        run_ranks("test_megatron_multi_lora_moe", "sync_rank", 2, free_port(), str(moe), str(out), engine.url,
                  [1, 1, 2, 2])
    lead, follower = (torch.load(f"{out}.{r}", weights_only=False) for r in range(2))
    assert [r.transport for r in follower["reports"]] == ["follower"] * 5
    base, *pushes = lead["reports"]
    assert base.what == "base" and [r.what for r in pushes] == ["adapter"] * 4
    assert [r.adapter_version for r in pushes] == [0, 0, 1, 1]
    assert pushes[1].bytes * 2 == pushes[0].bytes  # b's rank 2 is half a's 4: each slot its own tensors
    first, after_a, after_b = lead["gaps"]
    print(f"engine vs expert-2 trainer log-probs: {lead['gaps']}")
    assert max(first.values()) < ATOL and after_a["a"] < ATOL and max(after_b.values()) < ATOL, lead["gaps"]
    assert after_a["b"] > 1e-3  # b stepped but was not pushed: the engine still serves its version 0
    assert lead["gaps"] == follower["gaps"]
