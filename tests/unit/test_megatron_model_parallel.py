"""Pipeline and expert parallelism in the megatron trainer (backends/megatron/pipeline.py, the expert-parallel
parts of moe.py) on the CPU: MegatronBackend split over processes (real gloo groups, megatron-core's parallel_state,
its 1F1B schedule and its all-to-all token dispatcher; CUDA placement sent to the CPU by tests/megatron_cpu.py)
against the same job in one process.

What a user would notice: the same job trains the same adapter whichever the layout — pipeline 2, tensor 2,
tensor 2 x pipeline 2, pipeline 2 x data 2, and on a tiny Qwen3-MoE pipeline 2, expert 2 (data 2), pipeline 2 x
expert 2, tensor 2, tensor 2 x expert 2, that with the routers adapted too (Adapter mode), and tensor 2 x
pipeline 2 x expert 2; every layout at tensor 2 under sequence parallelism, dense or MoE:
the same LoRA init, the same losses, KL, grad norms and log-probs over 3 GRPO steps (fp32, 2 inner epochs, 3
micro-batches a minibatch; the tolerances below, the sums' order), every rank reporting the same metrics and
log-probs, the exported adapter whole on every rank under the one-process names, and checkpoints written split
resuming in one process and split again. And the engines serve what the ranks hold together: after each push from
a 2-stage, a tensor-2, a 2-expert-rank or a tensor 2 x expert 2 policy (rank 0 holding the transport, the other
following) a real reference engine's log-probs equal the trainer's (ATOL, fp32) in Merge, Adapter and EngineMerge
mode.
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
from tinymodel import make_tiny_model, make_tiny_moe_model

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not megatron_available(), reason="needs megatron-core (the test group installs it)"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for CUDA; tests/gpu covers GPUs")]

PROMPTS = [[1, 4, 5, 13, 6, 7, 14]] * 4 + [[1, 5, 6, 13, 7, 14]] * 4
RESPONSES = [[5, 6, 7, 2], [8, 8, 8, 2], [5, 6, 2], [9, 3], [7, 2], [5, 5, 9, 2], [6, 2], [8, 3, 3]]
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
STEPS = 3


def _cfg(model_dir: str, ckpt: str, mode: str = "Merge", tensor: int = 1, pipeline: int = 1, data: int = 1,
         expert: int = 1, router: bool = False):
    """The job; `router`: the MoE routers adapted too (SPEC rule 5: Adapter mode), as moe-adapter-mode.yaml does."""
    from kora_trainer.config import load_config

    if router:
        mode = "Adapter"

    overrides = [f"model.path={model_dir}", "data.path=unused.parquet", "lora.rank=4", "lora.alpha=8",
                 f"lora.syncMode={mode}", "rollout.engine=hf", "sync.bufferSize=64Ki", "algorithm.lr=0.01",
                 "algorithm.innerEpochs=2", "algorithm.klCoef=0.05", "algorithm.temperature=0.9",
                 f"parallelism.tensor={tensor}", f"parallelism.pipeline={pipeline}", f"parallelism.data={data}",
                 f"parallelism.expert={expert}", f"checkpoint.path={ckpt}"]
    targets = [*TARGETS, "router"] if router else TARGETS
    cfg, _ = load_config(None, overrides, base={"lora": {"rank": 4, "targetModules": targets}})
    return cfg


def run_rank(rank: int, world: int, port: int, model_dir: str, out: str, layout: list[int], resume: bool) -> None:
    """One rank of a (tensor, pipeline, data, expert, router) `layout`: STEPS GRPO steps (micro-batches of 3),
    metrics, log-probs, the export and a checkpoint; or, `resume`, the checkpoint loaded back and one more step."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from kora_trainer.backends.batch import RolloutBatch
    from kora_trainer.backends.megatron.backend import MegatronBackend
    from kora_trainer.backends.megatron.parallel import destroy_parallel
    from kora_trainer.checkpoint.training import restore_training_state, save_training_state

    tensor, pipeline, data, expert, router = layout
    ckpt = str(Path(out).parent / "ckpt")
    mg = MegatronBackend(_cfg(model_dir, ckpt, tensor=tensor, pipeline=pipeline, data=data, expert=expert,
                              router=bool(router)), dtype=torch.float32, micro_batch_size=3)
    res: dict = {"steps": [], "init": {n: t.clone() for n, t in mg.adapter_named()},
                 "init_export": {n: t.clone() for n, t in mg.peft_export()[0].items()},  # views of live tensors
                 # sequence parallelism: on in the model, and the LoRA factors it leaves partial summed over TP
                 "sequence_parallel": (mg.model.config.sequence_parallel, len(mg.dp.sequence_params))}
    if resume:
        res["resumed"] = restore_training_state(Path(ckpt), mg).step
    for _ in range(1 if resume else STEPS):
        old = mg.logprobs(PROMPTS, RESPONSES)
        m = mg.train_step(RolloutBatch(PROMPTS, RESPONSES, old, REWARDS, group_size=4))
        res["steps"].append({k: getattr(m, k) for k in ("loss", "kl", "grad_norm", "ratio", "clip_frac")}
                            | {"logp": old})
    res["after"] = {n: t.clone() for n, t in mg.adapter_named()}
    tensors, _, modules = mg.peft_export()
    res["export"], res["modules"] = tensors, modules
    if not resume:
        res["ckpt"] = save_training_state(Path(ckpt), mg, data_position=STEPS, keep=2)
    torch.save(res, f"{out}.{rank}")
    destroy_parallel()


def _run(root: Path, model_dir: Path, layout: tuple[int, ...], name: str, resume_from: str | None = None
         ) -> list[dict]:
    """`layout`: (tensor, pipeline, data[, expert[, router]]); expert parallelism is carved out of the data ranks
    (and, at tensor > 1, the TP ranks); router 1: the MoE routers adapted too, in Adapter mode."""
    layout = (*layout, *(1, 0)[len(layout) - 3:])  # expert 1, router 0 where not given
    out = root / name / "res.pt"
    out.parent.mkdir()
    if resume_from:
        import shutil

        shutil.copytree(root / resume_from / "ckpt", out.parent / "ckpt")
    world = layout[0] * layout[1] * layout[2]
    run_ranks("test_megatron_model_parallel", "run_rank", world, free_port(), str(model_dir), str(out), list(layout),
              resume_from is not None)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def tiny(root) -> tuple[Path, dict]:
    """(the 4-layer tiny Qwen3, its run at tensor 1 x pipeline 1 x data 1)."""
    model_dir = make_tiny_model(root / "tiny", layers=4)
    return model_dir, _run(root, model_dir, (1, 1, 1), "one")[0]


@pytest.fixture(scope="module")
def tiny_moe(root) -> tuple[Path, dict]:
    """(a 4-layer tiny Qwen3-MoE, layer 1 dense, 8 experts top-2; its run in one process)."""
    model_dir = make_tiny_moe_model(root / "tiny-moe", layers=4)
    return model_dir, _run(root, model_dir, (1, 1, 1), "one-moe")[0]


@pytest.fixture(scope="module")
def tiny_moe_router(root, tiny_moe) -> tuple[Path, dict]:
    """(the tiny Qwen3-MoE, its run in one process with the routers adapted too, in Adapter mode)."""
    return tiny_moe[0], _run(root, tiny_moe[0], (1, 1, 1, 1, 1), "one-moe-router")[0]


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-3)


def _same_export(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert set(got) == set(want)
    for n, t in want.items():
        assert torch.allclose(got[n], t, rtol=0.0, atol=atol), (n, float((got[n] - t).abs().max()))


# model, (tensor, pipeline, data[, expert]), tolerances (metrics relative, log-probs abs, exported adapter abs).
# Measured against the one-process run over the 3 steps (docs/megatron_backend.md): dense pipeline 2 bit-identical;
# with tensor (sequence parallel) or data parallelism, which sum shards and shares in another order, metrics within
# 2.9e-6 relative, log-probs within 1.2e-5, the exported adapter within 3.3e-6; MoE within 6.6e-6, 3.8e-5 and 1.1e-4
# (the router's and the all-to-all's sums, sequence parallelism's reduce-scatters, and AdamW turning a near-zero
# gradient's rounding into a whole step)
DENSE, MOE = (1e-5, 3e-5, 2e-5), (3e-5, 1e-4, 2e-4)
LAYOUTS = {"pipeline2": ("tiny", (1, 2, 1), DENSE), "tensor2": ("tiny", (2, 1, 1), DENSE),
           "tensor2-pipeline2": ("tiny", (2, 2, 1), DENSE),
           "pipeline2-data2": ("tiny", (1, 2, 2), DENSE), "moe-pipeline2": ("tiny_moe", (1, 2, 1), MOE),
           "moe-expert2": ("tiny_moe", (1, 1, 2, 2), MOE), "moe-pipeline2-expert2": ("tiny_moe", (1, 2, 2, 2), MOE),
           "moe-tensor2": ("tiny_moe", (2, 1, 1, 1), MOE), "moe-tensor2-expert2": ("tiny_moe", (2, 1, 1, 2), MOE),
           "moe-router-tensor2-expert2": ("tiny_moe_router", (2, 1, 1, 2, 1), MOE),
           "moe-tensor2-pipeline2-expert2": ("tiny_moe", (2, 2, 1, 2), MOE)}


# CI runs each kind of split once and the widest mixes (issue 41's CI budget); the other combinations of the same
# splits, under `make test-full`
FULL_LAYOUTS = {"tensor2-pipeline2", "moe-pipeline2", "moe-pipeline2-expert2", "moe-tensor2", "moe-tensor2-expert2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.full) if n in FULL_LAYOUTS else n
                                  for n in LAYOUTS])
def test_pipeline_stages_train_what_one_stage_trains(request, root, name):
    model, layout, (rel, logp_tol, export_tol) = LAYOUTS[name]
    model_dir, one = request.getfixturevalue(model)
    ranks = _run(root, model_dir, layout, name)
    # sequence parallelism exactly where tensor parallelism is (every tensor > 1 run, dense or MoE)
    assert not one["sequence_parallel"][0]
    for r in ranks:
        on, summed = r["sequence_parallel"]
        assert on == (layout[0] > 1) and (summed > 0) == on, r["sequence_parallel"]
    # the same LoRA init (the whole adapter, whatever the split), each stage holding its own layers by global index
    for r in ranks:
        _same_export(r["init_export"], one["init_export"], 0.0)
    if layout[:3] == (1, 2, 1):
        stage0, stage1 = (set(r["init"]) for r in ranks)
        assert not stage0 & stage1 and stage0 | stage1 == set(one["init"])
        assert {n.split(".")[2] for n in stage0} == {"0", "1"} and {n.split(".")[2] for n in stage1} == {"2", "3"}
        for r in ranks:
            for n, t in r["init"].items():
                assert torch.equal(t, one["init"][n]), n
    # every rank reports the same step, and it is the one-stage run's
    for step in range(STEPS):
        ref = one["steps"][step]
        for r in ranks:
            got = r["steps"][step]
            for k in ("loss", "kl", "grad_norm", "ratio", "clip_frac"):
                assert _close(got[k], ref[k], rel), (step, k, got[k], ref[k])
            diff = max(abs(x - y) for a, b in zip(got["logp"], ref["logp"], strict=True)
                       for x, y in zip(a, b, strict=True))
            assert diff < logp_tol, (step, diff)
        assert all(r["steps"][step] == ranks[0]["steps"][step] for r in ranks)
    # the trained adapter, exported whole on every rank under the one-stage names; global rank 0 writes
    for r in ranks:
        _same_export(r["export"], one["export"], export_tol)
        assert sorted(r["modules"]) == sorted(one["modules"])  # expert ranks list their own experts after rank 0's
    assert ranks[0]["ckpt"] is not None and all(r["ckpt"] is None for r in ranks[1:])


@pytest.mark.parametrize(("model", "split"), [("tiny", (1, 2, 1)), ("tiny_moe", (1, 1, 2, 2)), ("tiny", (2, 1, 1)),
                                               pytest.param("tiny_moe", (2, 1, 1, 2), marks=pytest.mark.full)],
                         ids=["pipeline2", "moe-expert2", "tensor2", "moe-tensor2-expert2"])
def test_a_split_checkpoint_resumes_in_one_process_and_split(request, root, model, split):
    model_dir, _ = request.getfixturevalue(model)
    rel, _, export_tol = DENSE if model == "tiny" else MOE
    name = "-".join(map(str, split))
    _run(root, model_dir, split, f"written-{name}")
    at1 = _run(root, model_dir, (1, 1, 1), f"resume1-{name}", resume_from=f"written-{name}")[0]
    at2 = _run(root, model_dir, split, f"resume2-{name}", resume_from=f"written-{name}")
    assert at1["resumed"] == STEPS and all(r["resumed"] == STEPS for r in at2)
    for k in ("loss", "kl", "grad_norm"):
        assert _close(at2[0]["steps"][0][k], at1["steps"][0][k], rel), k
    for r in at2:
        _same_export(r["export"], at1["export"], export_tol)


def sync_rank(rank: int, world: int, port: int, model_dir: str, out: str, url: str, mode: str,
              layout: list[int]) -> None:
    """One rank of a 2-rank policy (`layout`: tensor, pipeline, data, expert): a GRPO step, a push (rank 0 holds the
    colocated transport), the engine's greedy log-probs against the trainer's; twice."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from kora_trainer.backends.batch import RolloutBatch
    from kora_trainer.backends.megatron.backend import MegatronBackend
    from kora_trainer.backends.megatron.parallel import destroy_parallel
    from kora_trainer.sync.fast.path import with_fast_path
    from kora_trainer.sync.sender import POLICY_ADAPTER
    from kora_trainer.sync.transport import ColocatedTransport
    from kora_trainer.wire.engine_client import EngineClient

    tensor, pipeline, data, expert, _ = layout
    cfg = _cfg(model_dir, str(Path(out).parent / "ckpt"), mode, tensor, pipeline, data, expert)
    mg = MegatronBackend(cfg, dtype=torch.float32, micro_batch_size=3)
    client = EngineClient(url)
    sender = with_fast_path(mg.make_sender(ColocatedTransport([client]) if rank == 0 else None), cfg)
    res: dict = {"reports": [], "gaps": [], "stale": []}
    lora_path = POLICY_ADAPTER if mode == "Adapter" else None
    for push in range(2):
        mg.train_step(RolloutBatch(PROMPTS, RESPONSES, mg.logprobs(PROMPTS, RESPONSES), REWARDS, group_size=4))
        for key in ("stale", "gaps") if push else ("gaps",):  # stale: the engine still serves the last push
            if key == "gaps":
                res["reports"].append(sender.sync(mg.version))
                torch.distributed.barrier()  # as the driver does: generation resumes once every rank's push is done
            outs = client.generate(GREEDY_PROMPTS, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                                   lora_path=lora_path)
            ours = mg.logprobs(GREEDY_PROMPTS, [o.output_ids for o in outs])  # a collective of both ranks
            res[key].append(max(abs(x - y) for o, mine in zip(outs, ours, strict=True)
                                for x, y in zip(o.output_logprobs, mine, strict=True)))
    client.close()
    torch.save(res, f"{out}.{rank}")
    destroy_parallel()


# the split, its layout, the words that say why the fast path is off (in the first push's note)
SPLITS = {"pipeline2": ("dense", (1, 2, 1, 1, 0), "pipeline"), "moe-expert2": ("moe", (1, 1, 2, 2, 0), "MoE"),
          "tensor2": ("dense", (2, 1, 1, 1, 0), None),  # TP: the sender never wraps (fast_path_off)
          "moe-tensor2-expert2": ("moe", (2, 1, 1, 2, 0), None)}


# Merge runs in the CI-size suite; the other two modes take the same sources' other routes (`make test-full`)
@pytest.mark.parametrize("mode", ["Merge", pytest.param("Adapter", marks=pytest.mark.full),
                                  pytest.param("EngineMerge", marks=pytest.mark.full)])
@pytest.mark.parametrize("split", list(SPLITS))
def test_engines_serve_the_policy_two_ranks_hold(tmp_path, split, mode):
    kind, layout, why = SPLITS[split]
    model_dir = (make_tiny_model(tmp_path / "tiny", layers=4) if kind == "dense"
                 else make_tiny_moe_model(tmp_path / "tiny-moe", layers=4))
    out = tmp_path / "sync.pt"
    with served_engine(model_dir, tmp_path) as (engine, _):
        run_ranks("test_megatron_model_parallel", "sync_rank", 2, free_port(), str(model_dir), str(out), engine.url,
                  mode, list(layout))
    lead, follower = (torch.load(f"{out}.{r}", weights_only=False) for r in range(2))
    assert [r.transport for r in follower["reports"]] == ["follower"] * 2
    for r in lead["reports"]:
        assert r.pushed and r.path == "http" and r.transport == "colocated"
    assert why is None or why in lead["reports"][0].note  # why the fast path is off, printed
    assert all(g > 1e-3 for g in lead["stale"])  # each step moved the policy away from what was served
    assert all(g < ATOL for g in lead["gaps"]), lead["gaps"]
    assert lead["gaps"] == follower["gaps"]
