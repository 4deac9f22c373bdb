"""Multi-LoRA on the megatron backend (backends/megatron/multi_lora.py) on the CPU: megatron-core's real layers,
process groups and schedules over gloo (tests/megatron_cpu.py), adapter slots trained side by side.

What a user would notice:
- Independence at data 2: two adapters (ranks 4 and 2, their own seeds, rewards and learning rates) trained side by
  side end EXACTLY equal (bit for bit) to the first one trained alone at the same layout, step by step and at the
  end; each slot's AdamW state is split over the two ranks (each holds half) and its update is bit-identical to a
  whole AdamW's; a retired slot's name registers again from its fresh init (step 0, no AdamW state, no gradient)
  and its checkpoint state loads back exactly.
- The torch backend's slot trainer on the same base, from the same init and batches, reports the same losses
  (TORCH_LOSS absolute, KL and grad norms TORCH_REL relative) and ends with the same adapters (TORCH_ATOL): the one
  step both backends share (backends/multi_lora.py `_train_one`), with megatron's log-probs, clip and data-parallel
  sums. The targets are the row-parallel linears (linear_proj, linear_fc2) there: a fused megatron linear
  (linear_qkv, linear_fc1) shares one A between the HF projections it stands for (convert.adapter_to_hf), a
  different parametrisation from the torch backend's A per projection, so there the two agree only until the A's
  first move (the second update).
- Tensor 2 x pipeline 2 (`full`), all four targets and the row ones: both adapters train as in one process (the
  same init; metrics and adapters within SPLIT_REL / SPLIT_ATOL), independence holds bit for bit there too, the
  checkpoint state is the one-process state (names, order) and loads back split exactly.
- The engines serve what the slots hold (`full`): after each push of a slot from a tensor-2 or a pipeline-2 policy
  (rank 0 holding the colocated transport, the other following), a reference engine asked for that adapter by name
  gives the trainer's log-probs (ATOL), while the other adapter, stepped but not pushed, keeps its served version.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine_helpers import ATOL, served_engine
from engine_helpers import PROMPTS as GREEDY_PROMPTS
from kora_trainer.backends.megatron import megatron_available
from kora_trainer.wire.ports import free_port
from megatron_cpu import run_ranks
from tinymodel import make_tiny_model

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not megatron_available(), reason="needs megatron-core (the test group installs it)"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for CUDA; tests/gpu covers GPUs")]

PROMPTS = [[1, 4, 5, 13, 6, 7, 14]] * 4 + [[1, 5, 6, 13, 7, 14]] * 4
RESPONSES = [[5, 6, 7, 2], [8, 8, 8, 2], [5, 6, 2], [9, 3], [7, 2], [5, 5, 9, 2], [6, 2], [8, 3, 3]]
REWARDS = {"a": [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0], "b": [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]}
ROW = ["linear_proj", "linear_fc2"]
TARGETS = {"all": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "row": ROW}
STEPS = 3
METRICS = ("loss", "kl", "grad_norm", "clip_frac")
# measured (docs/multi_lora.md), 3 steps: the torch backend vs megatron at data 2, losses within 1.8e-7 (absolute: the
# first step's is 0 by construction), KL and grad norms 2.0e-6 relative, adapters 1.0e-6; tensor 2 x pipeline 2 vs one
# process (sequence parallelism's sums in another order), metrics within 4.4e-5 relative (the small losses), adapters
# 5.5e-6; on a 4-layer model 2.4e-5 and 4.4e-5 for a (lr 0.01), 6.1e-4 for one element of b's (lr 0.03: AdamW turns a
# near-zero gradient's rounding into a share of a whole lr-sized step)
TORCH_LOSS, TORCH_REL, TORCH_ATOL = 1e-5, 1e-4, 2e-5
SPLIT_REL, SPLIT_ATOL = 1e-4, 2e-3


def _cfg(model_dir: str, targets: list[str], tensor: int = 1, pipeline: int = 1, data: int = 1,
         backend: str = "megatron"):
    from kora_trainer.config import load_config

    overrides = [f"model.path={model_dir}", "data.path=unused.parquet", "lora.rank=4", "lora.alpha=8",
                 "lora.syncMode=Adapter", "rollout.engine=hf", "sync.bufferSize=64Ki", "algorithm.lr=0.01",
                 "algorithm.klCoef=0.05", "algorithm.rolloutBatchSize=2", "algorithm.nSamplesPerPrompt=4",
                 f"parallelism.tensor={tensor}", f"parallelism.pipeline={pipeline}", f"parallelism.data={data}",
                 f"backend={backend}", "multiLora.maxAdapters=2"]
    cfg, _ = load_config(None, overrides, base={"lora": {"rank": 4, "targetModules": targets}})
    return cfg


def settings(name: str):
    from kora_trainer.config.adapter_runs import AdapterSettings

    a = name == "a"
    return AdapterSettings(name=name, slot=0 if a else 1, rank=4 if a else 2, alpha=8.0 if a else 2.0,
                           lr=0.01 if a else 0.03, rollout_batch_size=2, n_samples_per_prompt=4,
                           data={"path": "unused.parquet"}, num_steps=STEPS, num_epochs=None, seed=1 if a else 7)


def train(trainer, names: list[str], steps: int = STEPS) -> list[dict]:
    """`steps` train calls of adapters `names` on the rollouts of their version 0: the first on-policy, the later
    ones a policy behind (the ratio moves off 1: a loss that is not 0 by construction)."""
    from kora_trainer.backends.batch import RolloutBatch

    out = []
    first = {n: trainer.logprobs(n, PROMPTS, RESPONSES) for n in names}
    for _ in range(steps):
        batches = {n: RolloutBatch(PROMPTS, RESPONSES, first[n], REWARDS[n], 4, ["0"] * len(PROMPTS)) for n in names}
        metrics = trainer.train(batches)
        out.append({m.name: {k: getattr(m, k) for k in METRICS} | {"logp": batches[m.name].rollout_logprobs,
                                                                    "gap": m.rollout_logp_gap_max}
                    for m in metrics})
    return out


def run_rank(rank: int, world: int, port: int, model_dir: str, out: str, layout: list[int], kinds: list[str]
             ) -> None:
    """One rank of `layout` (tensor, pipeline, data), for each of `kinds` of targets (all four, the row linears):
    adapters a and b beside each other, a retired and registered again, its state loaded back; then a alone."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from kora_trainer.backends.megatron.backend import MegatronBackend
    from kora_trainer.backends.megatron.multi_lora import MegatronMultiLoRATrainer
    from kora_trainer.backends.megatron.parallel import destroy_parallel

    res: dict = {}
    for kind in kinds:
        mg = MegatronBackend(_cfg(model_dir, TARGETS[kind], *layout), dtype=torch.float32, micro_batch_size=3)
        beside = MegatronMultiLoRATrainer(mg)
        for n in ("a", "b"):
            beside.add(settings(n))
        run = res[kind] = {"init": {n: dict(beside.adapter_named(n)) for n in ("a", "b")}}
        run["steps"] = train(beside, ["a", "b"])
        run["after"] = {n: dict(beside.adapter_named(n)) for n in ("a", "b")}
        a = beside.adapters["a"]  # this rank's AdamW moments of a, against a's factors on this rank
        run["adam"] = (sum(v.numel() for st in a.optimizer.state.values() for k, v in st.items() if k == "exp_avg"),
                       sum(p.numel() for p in a.slot.params))
        state = run["state"] = beside.state("a")
        beside.remove("a")
        beside.add(settings("a"))  # the retired name again: a fresh slot
        a = beside.adapters["a"]
        run["readded"] = (dict(beside.adapter_named("a")), a.step, len(a.optimizer.state),
                          [p.grad for p in a.slot.params])
        beside.load_state("a", state)
        run["reloaded"] = (dict(beside.adapter_named("a")), beside.step("a"), beside.state("a"))
        for n in ("a", "b"):
            beside.remove(n)
        alone = MegatronMultiLoRATrainer(mg)
        alone.add(settings("a"))
        run["alone"] = train(alone, ["a"])
        run["alone_after"] = dict(alone.adapter_named("a"))
        alone.remove("a")
        whole = MegatronMultiLoRATrainer(mg, shard_optimizer=False)  # every rank the slot's whole AdamW state
        whole.add(settings("a"))
        run["whole"] = train(whole, ["a"])
        run["whole_after"] = dict(whole.adapter_named("a"))
    torch.save(res, f"{out}.{rank}")
    destroy_parallel()


def _run(root: Path, model_dir: Path, layout: tuple[int, int, int], name: str, kinds: tuple[str, ...] = ("row",)
         ) -> list[dict]:
    out = root / name / "res.pt"
    out.parent.mkdir()
    world = layout[0] * layout[1] * layout[2]
    run_ranks("test_megatron_multi_lora", "run_rank", world, free_port(), str(model_dir), str(out), list(layout),
              list(kinds))
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlora")


@pytest.fixture(scope="module")
def tiny(root) -> Path:
    return make_tiny_model(root / "tiny", layers=2)


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-3)


def torch_run(model_dir: Path, init: dict, steps: list[dict]) -> tuple[list[dict], dict]:
    """The torch backend's slot trainer on the same base from megatron's init, on megatron's batches."""
    from kora_trainer.backends.batch import RolloutBatch
    from kora_trainer.backends.multi_lora import MultiLoRATrainer
    from kora_trainer.backends.torch_backend import TorchBackend

    trainer = MultiLoRATrainer(TorchBackend(_cfg(str(model_dir), ROW, backend="torch"), micro_batch_size=3))
    for n in ("a", "b"):
        trainer.add(settings(n))
        with torch.no_grad():
            for name, t in trainer.adapter_named(n):
                t.copy_(init[n][name])
    got = []
    for step in steps:
        batches = {n: RolloutBatch(PROMPTS, RESPONSES, step[n]["logp"], REWARDS[n], 4, ["0"] * len(PROMPTS))
                   for n in ("a", "b")}
        got.append({m.name: {k: getattr(m, k) for k in METRICS} for m in trainer.train(batches)})
    return got, {n: {k: t.clone() for k, t in trainer.adapter_named(n)} for n in ("a", "b")}


def check_slots(ranks: list[dict], kind: str, data: int = 1) -> None:
    """Independence, every rank alike, retire and register again, the state loaded back (each rank's own run)."""
    run = ranks[0][kind]
    for r in ranks[1:]:
        assert r[kind]["steps"] == run["steps"]  # every rank reports the same step
    # independence: a beside b is a alone, bit for bit, every step and at the end
    assert [s["a"] for s in run["steps"]] == [s["a"] for s in run["alone"]]
    assert _max_diff(run["after"]["a"], run["alone_after"]) == 0.0
    # its AdamW state split over the data-parallel ranks, and the same update as a whole AdamW's, bit for bit
    for rank, r in enumerate(ranks):
        held, factors = r[kind]["adam"]
        share = -(-factors // data)  # each data-parallel rank's range, the last one what is left
        assert held == min(share, factors - (rank % data) * share), (rank, held, factors)
    assert [s["a"] for s in run["whole"]] == [s["a"] for s in run["alone"]]
    assert _max_diff(run["whole_after"], run["alone_after"]) == 0.0
    moved = [n for n, t in run["after"]["a"].items() if n.endswith("lora_B.weight") and t.abs().max() > 0]
    assert moved, "the adapter never moved: the test would prove nothing"
    assert _max_diff(run["after"]["b"], run["init"]["b"]) > 0  # b trained too, on its own
    assert all(run["steps"][0][n]["gap"] < 1e-5 for n in ("a", "b"))  # on-policy: trainer vs its own rollouts
    assert all(s[n]["gap"] is None and s[n]["loss"] != 0.0 for s in run["steps"][1:] for n in ("a", "b"))
    # each slot its own rank under HF-PEFT names
    assert {t.shape[0] for n, t in run["after"]["b"].items() if n.endswith("lora_A.weight")} == {2}
    for r in ranks:  # retire and register again: a fresh slot; the checkpoint state loads back exactly
        fresh, step, opt_state, grads = r[kind]["readded"]
        assert _max_diff(fresh, run["init"]["a"]) == 0.0 and step == 0 and opt_state == 0
        assert all(g is None for g in grads)
        reloaded, step, state = r[kind]["reloaded"]
        assert _max_diff(reloaded, run["after"]["a"]) == 0.0 and step == STEPS
        assert _max_diff(state["tensors"], r[kind]["state"]["tensors"]) == 0.0


def test_two_adapters_at_data_2_end_as_each_alone_and_as_the_torch_backend(root, tiny):
    ranks = _run(root, tiny, (1, 1, 2), "data2")
    check_slots(ranks, "row", data=2)
    # the torch backend, same base, init and batches
    row = ranks[0]["row"]
    got, after = torch_run(tiny, row["init"], row["steps"])
    losses = max(abs(g[n]["loss"] - w[n]["loss"]) for g, w in zip(got, row["steps"], strict=True) for n in "ab")
    rel = max(_rel(g[n][k], w[n][k]) for g, w in zip(got, row["steps"], strict=True) for n in "ab"
              for k in ("kl", "grad_norm"))
    adapters = max(_max_diff(after[n], row["after"][n]) for n in "ab")
    print(f"torch vs megatron at data 2: losses within {losses:.1e}, KL and grad norms {rel:.1e} relative, "
          f"adapters {adapters:.1e}")
    assert losses < TORCH_LOSS and rel < TORCH_REL and adapters < TORCH_ATOL


@pytest.mark.full
def test_two_adapters_at_tensor_2_pipeline_2_train_as_in_one_process(root, tiny):
    one = _run(root, tiny, (1, 1, 1), "one", ("all", "row"))[0]
    ranks = _run(root, tiny, (2, 2, 1), "tensor2-pipeline2", ("all", "row"))
    worst = {"metrics": 0.0, "adapters": 0.0}
    for kind in ("all", "row"):
        check_slots(ranks, kind)
        got, want = ranks[0][kind], one[kind]
        for n in ("a", "b"):
            assert _max_diff(got["init"][n], want["init"][n]) == 0.0  # the same init whatever the split
            worst["adapters"] = max(worst["adapters"], _max_diff(got["after"][n], want["after"][n]))
            for g, w in zip(got["steps"], want["steps"], strict=True):
                worst["metrics"] = max(worst["metrics"], *(_rel(g[n][k], w[n][k]) for k in METRICS))
        # the checkpoint state is the one-process state: whole factors under megatron's names, in its order
        assert list(got["state"]["tensors"]) == list(want["state"]["tensors"])
        worst["adapters"] = max(worst["adapters"], _max_diff(got["state"]["tensors"], want["state"]["tensors"]))
    print(f"tensor 2 x pipeline 2 vs one process: metrics {worst['metrics']:.1e} relative, adapters "
          f"{worst['adapters']:.1e}")
    assert worst["metrics"] < SPLIT_REL and worst["adapters"] < SPLIT_ATOL


def sync_rank(rank: int, world: int, port: int, model_dir: str, out: str, url: str, layout: list[int]) -> None:
    """One rank of a 2-rank policy (`layout`: tensor, pipeline, data) with slots a and b (rank 0 holds the colocated
    transport): the base pushed once, each adapter by name; a trained and pushed alone, then b."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from kora_trainer.backends.megatron.backend import MegatronBackend

    mg = MegatronBackend(_cfg(model_dir, TARGETS["all"], *layout), dtype=torch.float32, micro_batch_size=3)
    serve_two_slots(mg, rank, url, out)


def serve_two_slots(mg, rank: int, url: str, out: str) -> None:
    """Slots a and b on `mg` pushed to the engine at `url` (rank 0's colocated transport) and checked after each
    push: the engine's greedy log-probs per adapter name against the trainer's (`res["gaps"]`), saved to out.rank."""
    from kora_trainer.backends.megatron.multi_lora import MegatronMultiLoRATrainer
    from kora_trainer.backends.megatron.parallel import destroy_parallel
    from kora_trainer.sync.transport import ColocatedTransport
    from kora_trainer.wire.engine_client import EngineClient

    trainer = MegatronMultiLoRATrainer(mg)
    for n in ("a", "b"):
        trainer.add(settings(n))
    client = EngineClient(url)
    sender = trainer.make_sender(ColocatedTransport([client]) if rank == 0 else None)
    res: dict = {"reports": [sender.push_base()], "gaps": []}

    def publish(name: str) -> None:
        config = trainer.peft_config(name)
        with trainer.active(name):
            res["reports"].append(sender.publish(name, trainer.step(name), config))
        torch.distributed.barrier()  # as the driver does: generation resumes once every rank's push is done

    def gaps() -> dict[str, float]:
        out = {}
        for n in ("a", "b"):
            outs = client.generate(GREEDY_PROMPTS, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                                   lora_path=n)
            ours = trainer.logprobs(n, GREEDY_PROMPTS, [o.output_ids for o in outs])  # a collective of both ranks
            out[n] = max(abs(x - y) for o, mine in zip(outs, ours, strict=True)
                         for x, y in zip(o.output_logprobs, mine, strict=True))
        return out

    for n in ("a", "b"):
        publish(n)
    res["gaps"].append(gaps())  # both at version 0
    train(trainer, ["a", "b"], steps=1)
    publish("a")
    res["gaps"].append(gaps())  # a served as trained, b one version behind
    publish("b")
    res["gaps"].append(gaps())
    client.close()
    torch.save(res, f"{out}.{rank}")
    destroy_parallel()


@pytest.mark.full  # an engine and two ranks: over a minute on the shared CI machine
@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 1)], ids=["tensor2", "pipeline2"])
def test_engines_serve_each_slot_by_name_as_two_ranks_hold_it(tmp_path, layout):
    model_dir = make_tiny_model(tmp_path / "tiny", layers=2)
    out = tmp_path / "sync.pt"
    with served_engine(model_dir, tmp_path) as (engine, _):
        run_ranks("test_megatron_multi_lora", "sync_rank", 2, free_port(), str(model_dir), str(out), engine.url,
                  list(layout))
    lead, follower = (torch.load(f"{out}.{r}", weights_only=False) for r in range(2))
    assert [r.transport for r in follower["reports"]] == ["follower"] * 5
    base, *pushes = lead["reports"]
    assert base.what == "base" and [r.what for r in pushes] == ["adapter"] * 4
    assert [r.adapter_version for r in pushes] == [0, 0, 1, 1]
    assert pushes[1].bytes * 2 == pushes[0].bytes  # b's rank 2 is half a's 4: each slot its own tensors
    first, after_a, after_b = lead["gaps"]
    assert max(first.values()) < ATOL and after_a["a"] < ATOL and max(after_b.values()) < ATOL, lead["gaps"]
    assert after_a["b"] > 1e-3  # b stepped but was not pushed: the engine still serves its version 0
    assert lead["gaps"] == follower["gaps"]
