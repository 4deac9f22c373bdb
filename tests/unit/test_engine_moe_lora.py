"""The reference engine (a real process on 127.0.0.1) serving and folding Qwen3-MoE adapters in PEFT's layout:
attention LoRA by `target_modules`, and by `target_parameters` the fused experts (`mlp.experts.gate_up_proj`
[E, 2I, H] / `down_proj` [E, H, I], grouped lora_A [E·r, in], lora_B [out, r·E]), the routers
(`model.layers.{i}.mlp.gate.weight`) and the dense layer's MLP by full path.

The reference is peft 0.21 itself (`PeftModel.from_pretrained` on the same checkpoint), so an engine that read
the grouped layout the other way round (rank-major A, expert-major B) fails; `test_a_swapped_expert_layout_…`
shows that such a swap moves the outputs far beyond the tolerance. Tiny model: 3 layers (layer 1 dense), hidden
64, 8 experts top-2, moe_intermediate 24 (so the experts are not square), vocab 16; LoRA r = 4, alpha = 8,
factors N(0, 0.2).

The last test pushes kora's own policy (TorchBackend on the MoE, expert + router LoRA) in Adapter and EngineMerge
modes and compares with the trainer's log-probs.

Tolerance TOL = 1e-5 on log-probs, fp32: with one adapter for the whole batch the engine forms the adapted
weights exactly as peft does; a batch that mixes adapters runs each owning module on row subsets, and padding /
the KV cache change the summation order only (measured ≤ 4.3e-6; 0.0 for a single in-process forward).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from test_engine_weight_sync import lora_merge_push

from engine_helpers import (
    PROMPTS,
    broadcast_bucket,
    engine_vs_reference,
    load_hf,
    logprob_gap,
    peft_config_dict,
    peft_tensors,
    start_engine,
    stop_engine,
    trained_policy,
    trainer_group,
)
from kora_trainer.sync.sender import POLICY_ADAPTER, WeightSender
from kora_trainer.sync.transport import ColocatedTransport
from kora_trainer.wire.engine_client import EngineClient, EngineError
from kora_trainer.wire.protocol import FLAT, plan_buckets
from kora_trainer.wire.serialize import serialize_named_tensors
from tinymodel import make_tiny_moe_model

pytestmark = pytest.mark.timeout(300)
TOL = 1e-5
VOCAB, EXPERTS, R = 16, 8, 4
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ROUTERS = ["model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"]
DENSE_MLP = [f"model.layers.1.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]


def moe_adapter(model_dir, out, seed: int, parameters: list[str], modules: list[str] = ATTENTION):
    """An adapter made by peft (every factor random, so each part moves the output), saved; (dir, peft model)."""
    model = get_peft_model(load_hf(model_dir), LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=0.0,
                                                          target_modules=modules, target_parameters=parameters))
    g = torch.Generator().manual_seed(seed)
    for p in (p for n, p in model.named_parameters() if "lora_" in n):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(out)
    return out, PeftModel.from_pretrained(load_hf(model_dir), out).eval()


def distributions(client, prompts, loras) -> list[torch.Tensor]:
    """Each prompt's next-token log-probs over the whole vocabulary at every prompt position: its logits up to a
    per-position constant (input_top_logprobs with top_logprobs_num = vocab)."""
    outs = client.generate(prompts, {"max_new_tokens": 1, "temperature": 0.0}, lora_path=loras,
                           logprob_start_len=0, top_logprobs_num=VOCAB)
    dists = []
    for out in outs:
        rows = out.meta_info["input_top_logprobs"][1:]
        t = torch.empty(len(rows), VOCAB)
        for j, row in enumerate(rows):
            for lp, tok, *_ in row:
                t[j, tok] = lp
        dists.append(t)
    return dists


@torch.no_grad()
def reference_distribution(model, prompt) -> torch.Tensor:
    return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def gap(client, prompts, loras, references) -> float:
    """Largest |engine − reference| over the prompt distributions and the greedy continuations."""
    worst = 0.0
    for prompt, lora, dist in zip(prompts, loras, distributions(client, prompts, loras), strict=True):
        worst = max(worst, float((dist - reference_distribution(references[lora], prompt)).abs().max()))
    for lora in dict.fromkeys(loras):
        worst = max(worst, engine_vs_reference(client, references[lora], lora_path=lora))
    return worst


def swap_expert_layout(named):
    """The grouped expert factors read the other way round: A rows rank-major, B columns expert-major."""
    out = []
    for name, t in named:
        if ".mlp.experts." in name and ".lora_A." in name:
            t = t.reshape(EXPERTS, R, -1).transpose(0, 1).reshape(EXPERTS * R, -1)
        elif ".mlp.experts." in name:
            t = t.reshape(t.shape[0], R, EXPERTS).transpose(1, 2).reshape(t.shape[0], -1)
        out.append((name, t.contiguous()))
    return out


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp("moe"), vocab=VOCAB, experts=EXPERTS, moe_intermediate=24)


@pytest.fixture(scope="module")
def base(moe_dir):
    return load_hf(moe_dir)


@contextmanager
def engine_client(model_dir, log_dir, *flags: str) -> Iterator[EngineClient]:
    """A client of a fresh engine process on `model_dir`, stopped on exit."""
    proc = start_engine(model_dir, log_dir, *flags)
    try:
        with proc.client(timeout=120) as c:
            yield c
    finally:
        stop_engine(proc)


@pytest.fixture(scope="module")
def client(moe_dir, tmp_path_factory):
    with engine_client(moe_dir, tmp_path_factory.mktemp("logs"), "--max-loras-per-batch", "4") as c:
        yield c


@pytest.fixture(scope="module")
def adapters(moe_dir, client, tmp_path_factory):
    """'moe': attention + experts + routers + dense MLP (from its dir); 'dense': q/v only (r=4, a plain
    target_modules adapter); 'experts': attention + experts only (from tensors)."""
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "moe": moe_adapter(moe_dir, root / "moe", 1, EXPERT_PARAMS + ROUTERS + DENSE_MLP),
        "dense": moe_adapter(moe_dir, root / "dense", 2, [], ["q_proj", "v_proj"]),
        "experts": moe_adapter(moe_dir, root / "experts", 3, EXPERT_PARAMS),
    }
    client.load_lora_adapter("moe", str(made["moe"][0]))
    client.load_lora_adapter("dense", str(made["dense"][0]))
    peft_model = made["experts"][1]
    client.load_lora_adapter_from_tensors("experts", peft_config_dict(peft_model),
                                          serialize_named_tensors(peft_tensors(peft_model)))
    return {name: model for name, (_, model) in made.items()}


def test_moe_adapter_served_equals_peft(client, adapters, base):
    peft_model = adapters["moe"]
    assert gap(client, PROMPTS, ["moe"] * 3, {"moe": peft_model}) < TOL
    assert engine_vs_reference(client, base, lora_path="moe") > 0.1  # the adapter moves the log-probs
    # each parameter-targeted part matters on its own: dropping the experts' or the routers' factors moves peft
    for part, name in ((".mlp.experts.", "no-experts"), (".mlp.gate.", "no-routers")):
        named = [(n, t * 0 if part in n and ".lora_B." in n else t) for n, t in peft_tensors(peft_model)]
        client.load_lora_adapter_from_tensors(name, peft_config_dict(peft_model), serialize_named_tensors(named))
        assert engine_vs_reference(client, peft_model, lora_path=name) > 1e-2
    assert engine_vs_reference(client, base) < TOL  # the base rows are untouched


def test_experts_adapter_from_tensors_equals_peft(client, adapters):
    assert gap(client, PROMPTS, ["experts"] * 3, adapters) < TOL


def test_a_swapped_expert_layout_is_not_pefts(client, adapters):
    peft_model = adapters["experts"]
    client.load_lora_adapter_from_tensors("swapped", peft_config_dict(peft_model),
                                          serialize_named_tensors(swap_expert_layout(peft_tensors(peft_model))))
    assert engine_vs_reference(client, peft_model, lora_path="swapped") > 1e-2


def test_dense_and_moe_adapters_share_one_batch(client, adapters, base):
    # base + three adapters with --max-loras-per-batch 4: one forward batch, rows split per adapter in the MoE blocks
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    loras = [None, "dense", "moe", "experts", "dense", "moe"]
    assert gap(client, prompts, loras, {None: base, **adapters}) < TOL


def test_moe_adapter_over_the_group_is_upserted(client, adapters, moe_dir, tmp_path):
    peft_model = moe_adapter(moe_dir, tmp_path / "pushed", 4, EXPERT_PARAMS + ROUTERS)[1]
    named = peft_tensors(peft_model)
    buckets = plan_buckets([[nt] for nt in named], 4096)  # the grouped expert factors split across buckets
    with trainer_group(client) as group:
        for i, bucket in enumerate(buckets):
            fut = client.submit(client.load_lora_adapter_from_distributed, "kora-policy",
                                peft_config_dict(peft_model), bucket.metadata(), bucket_index=i,
                                num_buckets=len(buckets))
            broadcast_bucket(group, bucket, dict(named), FLAT)
            assert fut.result(timeout=60)["success"]
    assert len(buckets) > 1
    assert gap(client, PROMPTS, ["kora-policy"] * 3, {"kora-policy": peft_model}) < TOL


# ---- EngineMerge (weight_update_mode lora_merge), on an engine of its own: merges change its base -------------

@pytest.fixture(scope="module")
def merge_engine(moe_dir, tmp_path_factory):
    with engine_client(moe_dir, tmp_path_factory.mktemp("merge-logs")) as c, trainer_group(c) as group:
        yield c, group


def test_engine_merge_folds_expert_pairs_like_peft(merge_engine, moe_dir, tmp_path):
    client, group = merge_engine
    for seed in (5, 6):  # the second merge starts again from the pristine base: merges never accumulate
        out, peft_model = moe_adapter(moe_dir, tmp_path / f"m{seed}", seed, EXPERT_PARAMS + DENSE_MLP)
        merged = PeftModel.from_pretrained(load_hf(moe_dir), out).merge_and_unload().eval()
        assert engine_vs_reference(client, merged) > 1e-2
        assert lora_merge_push(client, group, peft_tensors(peft_model), 2.0 * R, R, cap=16384) > 1
        assert gap(client, PROMPTS, [None] * 3, {None: merged}) < TOL


def test_engine_merge_refuses_a_router_pair(merge_engine, moe_dir, tmp_path):
    client, group = merge_engine
    _, peft_model = moe_adapter(moe_dir, tmp_path / "r", 7, EXPERT_PARAMS + ROUTERS)
    named = peft_tensors(peft_model)
    before = distributions(client, PROMPTS, None)
    bucket = plan_buckets([named], 1 << 22)[0]  # experts and routers in one push
    fut = client.submit(client.update_weights_lora_merge, bucket.metadata(), 2.0 * R, R, load_format=FLAT)
    broadcast_bucket(group, bucket, dict(named), FLAT)
    with pytest.raises(EngineError) as err:
        fut.result(timeout=60)
    assert err.value.status == 400
    assert "SPEC rule 5" in err.value.message and "model.layers.0.mlp.gate" in err.value.message
    after = distributions(client, PROMPTS, None)  # refused before any weight changed
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


@pytest.mark.parametrize(("mode", "targets"), [("Adapter", "[linear_qkv, linear_fc1, linear_fc2, router]"),
                                               ("EngineMerge", "[linear_qkv, linear_fc1, linear_fc2]")])
def test_torch_backend_moe_policy_is_served_after_sync(merge_engine, moe_dir, mode, targets):
    """kora's own push (TorchBackend on the MoE, in-memory transport) of expert / router adapters."""
    client, _ = merge_engine
    b = trained_policy(moe_dir, mode, 8, 16384, targets)
    lora_path = POLICY_ADAPTER if mode == "Adapter" else None
    if mode == "EngineMerge":
        assert logprob_gap(client, b, lora_path) > 1e-2
    assert WeightSender(b.model, b.cfg, ColocatedTransport([client])).sync(version=1).pushed
    assert logprob_gap(client, b, lora_path) < TOL

