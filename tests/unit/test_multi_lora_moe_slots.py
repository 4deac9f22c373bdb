"""Multi-LoRA on a Qwen3-MoE (issue 44 item 3): adapter slots hold per-expert adapters on the fused experts (PEFT's
grouped layout at each slot's own rank) and the router's adapter, beside the attention linears.

What a user relies on: two adapters of different ranks train on one tiny MoE base, each moving its own expert and
router factors; each one's HF-PEFT export (`target_parameters` as the single-adapter path writes it) loads in
peft 0.21 and gives kora's logits; an adapter trained beside another ends bit-identical to the same adapter trained
alone (its own RNG stream and AdamW), and a slot restored from its state goes on bit for bit; the reference engine
serves both adapters in one batch as the trainer holds them after kora's Adapter-mode push (SlotSender, in-memory
transport; over the weight-update group: tests/e2e/test_multi_lora_moe.py, `full`).

Tolerance TOL = 1e-5 on logits / log-probs (fp32; peft forms W + s·B·A as kora does, the engine on row subsets).
Tiny model: 3 layers (layer 1 dense), hidden 64, 8 experts top-2, moe_intermediate 24, vocab 16; job rank 4.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from engine_helpers import PROMPTS, load_hf, start_engine, stop_engine
from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.backends.multi_lora import MultiLoRATrainer
from kora_trainer.backends.torch_backend import TorchBackend
from kora_trainer.checkpoint.peft_export import export_peft
from kora_trainer.config import load_config
from kora_trainer.config.adapter_runs import AdapterSettings
from kora_trainer.config.sections import DataSpec
from kora_trainer.sync.slot_sender import SlotSender
from kora_trainer.sync.transport import ColocatedTransport
from tinymodel import make_tiny_moe_model

pytestmark = pytest.mark.timeout(180)  # the engine test starts a process
TOL = 1e-5
EXPERTS, R = 8, 4
TARGETS = "[linear_qkv, linear_fc1, linear_fc2, router]"
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4], [1, 6, 2, 8, 13, 14, 12, 5]])
# experts gate_up before down (PEFT nests them in that order), the routers and the dense layer's MLP by path
TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "model.layers.0.mlp.gate.weight",
                     "model.layers.2.mlp.gate.weight", *[f"model.layers.1.mlp.{p}.weight" for p in
                                                         ("gate_proj", "up_proj", "down_proj")]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp("moe"), experts=EXPERTS, moe_intermediate=24)


def backend(model_dir, slots: int) -> TorchBackend:
    """The torch backend on the MoE at the job's rank 4 / alpha 8; `slots` 0: the single-adapter job."""
    cfg, _ = load_config(None, [f"model.path={model_dir}", "data.path=unused.parquet", f"lora.rank={R}",
                                "lora.alpha=8", "lora.syncMode=Adapter", f"lora.targetModules={TARGETS}",
                                f"multiLora.maxAdapters={slots}", "rollout.engine=hf"])
    return TorchBackend(cfg, device="cpu", threads=1)


def trainer(model_dir, *names: str) -> MultiLoRATrainer:
    """A multi-LoRA trainer on the MoE with adapters `names` (a: rank 4 as the job, b: rank 2) in slots."""
    multi = MultiLoRATrainer(backend(model_dir, 2))
    for name in names:
        rank = {"a": 4, "b": 2}[name]
        multi.add(AdapterSettings(name=name, slot=len(multi.adapters), rank=rank, alpha=2.0 * rank, lr=0.05,
                                  rollout_batch_size=2, n_samples_per_prompt=4, data=DataSpec(path="unused.parquet"),
                                  num_steps=3, num_epochs=None, seed={"a": 11, "b": 7}[name]))
    return multi


def batch(multi: MultiLoRATrainer, name: str, seed: int) -> RolloutBatch:
    """2 prompts x 4 samples of random tokens, mixed rewards per group, the adapter's own log-probs as the rollout's."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[1, *torch.randint(3, 15, (5,), generator=g).tolist()] for _ in range(2) for _ in range(4)]
    responses = [torch.randint(3, 15, (3,), generator=g).tolist() for _ in range(8)]
    return RolloutBatch(prompts, responses, multi.logprobs(name, prompts, responses),
                        [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0], group_size=4)


def train(multi: MultiLoRATrainer, names: tuple[str, ...], steps: int = 2) -> None:
    for step in range(steps):
        multi.train({n: batch(multi, n, 100 * step + ord(n)) for n in names})


@pytest.fixture(scope="module")
def both(moe_dir):
    multi = trainer(moe_dir, "a", "b")
    train(multi, ("a", "b"))
    return multi


def test_slots_hold_per_expert_and_router_adapters_that_train(both):
    for name, r in (("a", 4), ("b", 2)):
        factors = dict(both.adapter_named(name))
        experts = "base_model.model.model.layers.0.mlp.experts"
        assert tuple(factors[f"{experts}.base_layer.lora_A.weight"].shape) == (EXPERTS * r, 64)  # gate_up
        assert tuple(factors[f"{experts}.base_layer.lora_B.weight"].shape) == (48, r * EXPERTS)
        assert tuple(factors[f"{experts}.lora_B.weight"].shape) == (64, r * EXPERTS)  # down_proj
        assert tuple(factors["base_model.model.model.layers.2.mlp.gate.lora_B.weight"].shape) == (EXPERTS, r)
        for key in (f"{experts}.base_layer.lora_B.weight", f"{experts}.lora_B.weight",
                    "base_model.model.model.layers.0.mlp.gate.lora_B.weight"):
            assert factors[key].abs().max() > 0, f"{name}: {key} never moved"
    a, b = dict(both.adapter_named("a")), dict(both.adapter_named("b"))
    assert a.keys() == b.keys()


def test_the_export_is_the_single_adapter_paths(both, moe_dir):
    """Adapter a (the job's rank and alpha) exports the config and tensor names / shapes of a one-adapter job."""
    tensors, config, _ = backend(moe_dir, 0).peft_export()
    assert config["target_parameters"] == TARGET_PARAMETERS
    assert both.peft_config("a") == config
    assert {n: t.shape for n, t in both.adapter_named("a")} == {n: t.shape for n, t in tensors.items()}


def test_each_export_loads_in_peft_with_the_trainers_logits(both, moe_dir, tmp_path):
    base = load_hf(moe_dir)
    with torch.no_grad():
        plain = base(IDS).logits
    for name, r in (("a", 4), ("b", 2)):
        config = both.peft_config(name)
        assert config["r"] == r and config["lora_alpha"] == 2.0 * r
        assert config["target_parameters"] == TARGET_PARAMETERS
        assert sorted(config["target_modules"]) == ["k_proj", "q_proj", "v_proj"]
        out = export_peft(tmp_path / name, dict(both.adapter_named(name)), config, {})
        with torch.no_grad(), both.slots.active(name):
            ours = both.backend.model(IDS).logits
        theirs = PeftModel.from_pretrained(load_hf(moe_dir), str(out)).eval()
        with torch.no_grad():
            got = theirs(IDS).logits
        assert (ours - plain).abs().max() > 1e-3  # the trained adapter moves the logits
        assert (got - ours).abs().max() < TOL, name


def test_an_adapter_trained_beside_another_equals_it_alone(both, moe_dir):
    alone = trainer(moe_dir, "a")
    train(alone, ("a",))
    beside, by_itself = dict(both.adapter_named("a")), dict(alone.adapter_named("a"))
    assert beside.keys() == by_itself.keys()
    assert all(torch.equal(beside[k], by_itself[k]) for k in beside)


def test_a_slot_restored_from_its_state_goes_on_as_if_never_stopped(both, moe_dir):
    """MultiLoRATrainer.state / load_state (what the adapter checkpoint holds: expert and router factors, AdamW
    state, step, RNG) into a fresh trainer, then the second step: equal to both's `b` bit for bit."""
    once = trainer(moe_dir, "b")
    train(once, ("b",), steps=1)
    resumed = trainer(moe_dir, "b")
    resumed.load_state("b", once.state("b"))
    resumed.train({"b": batch(resumed, "b", 100 + ord("b"))})
    got, want = dict(resumed.adapter_named("b")), dict(both.adapter_named("b"))
    assert resumed.adapters["b"].step == 2 and all(torch.equal(got[k], want[k]) for k in want)


def gap(outs, logprobs) -> float:
    """Largest |engine - trainer| log-prob over the generated tokens."""
    return max(abs(x - y) for o, row in zip(outs, logprobs, strict=True)
               for x, y in zip(o.output_logprobs, row, strict=True))


def test_the_engine_serves_both_moe_adapters_as_trained(both, moe_dir, tmp_path):
    """kora's Adapter-mode push of each slot (base once, then each adapter under its name) to the reference engine:
    each adapter's greedy continuations carry the trainer's log-probs."""
    proc = start_engine(moe_dir, tmp_path, "--max-lora-rank", str(R), "--max-loras-per-batch", "2")
    try:
        with proc.client(timeout=120) as client:
            sender = SlotSender(both.backend.model, both.backend.cfg, ColocatedTransport([client]))
            assert sender.push_base().pushed
            for name in ("a", "b"):  # as MultiLoRAWorker.publish does it
                config = both.peft_config(name)
                with both.slots.active(name):
                    assert sender.publish(name, both.adapters[name].step, config).pushed
            outs = client.generate(PROMPTS * 2, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                                   lora_path=["a"] * len(PROMPTS) + ["b"] * len(PROMPTS))
            for i, (name, other) in enumerate((("a", "b"), ("b", "a"))):
                mine = outs[i * len(PROMPTS):(i + 1) * len(PROMPTS)]
                ids = [o.output_ids for o in mine]
                assert gap(mine, both.logprobs(name, PROMPTS, ids)) < TOL, name
                assert gap(mine, both.logprobs(other, PROMPTS, ids)) > 100 * TOL  # each row got its own adapter
    finally:
        stop_engine(proc)
