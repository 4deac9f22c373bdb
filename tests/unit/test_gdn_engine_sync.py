"""LoRA on a Qwen3.5-style GDN model (tests/gdnkit.py, loaded from disk by the real TorchBackend) synced to the real
reference engine (a separate process) over a real gloo weight-update group:

- Adapter mode: the in_proj adapters go out under SGLang's fused names (in_proj_q/k/v/z -> in_proj_qkvz), the b/a
  gate adapters are pinned to zero in training and not pushed (the stock build has no in_proj_ba adapter), and the
  engine's log-probs equal the trainer's;
- with the pin switched off (the test-only GATE_MASK_OFF_ENV) the trainer trains gates the engine never gets: the
  gap is plain, so the check above can fail;
- Merge mode pins nothing and folds every row, gates included: the engine serves the unmasked policy;
- the HF-PEFT export (HF names) loads with peft and gives the trainer's logits; `kora merge` of it too.

Tolerance as in test_sync_engine.py (ATOL = 1e-4: fp32 both sides, summation order only).
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import ATOL, logprob_gap, start_engine, stop_engine
from gdnkit import GDN_TARGETS, make_tiny_gdn_model, randomize_adapter
from kora_trainer.backends.torch_backend import TorchBackend
from kora_trainer.checkpoint.merge import merge
from kora_trainer.checkpoint.peft_export import export_peft
from kora_trainer.config import load_config
from kora_trainer.lora.gdn import GATE_MASK_OFF_ENV, pin_gate_rows
from kora_trainer.sync.sender import POLICY_ADAPTER, WeightSender
from kora_trainer.sync.transport import DistributedTransport
from kora_trainer.wire.engine_client import EngineError

VISIBLE = 1e-2  # an unserved adapter of this size moves log-probs by far more than ATOL


@pytest.fixture(scope="module")
def gdn_dir(tmp_path_factory):
    return make_tiny_gdn_model(tmp_path_factory.mktemp("gdn") / "gdn")


@pytest.fixture(scope="module")
def engine(gdn_dir, tmp_path_factory):
    proc = start_engine(gdn_dir, tmp_path_factory.mktemp("logs"), "--max-lora-rank", "8")
    yield proc
    stop_engine(proc)


def gdn_policy(model_dir, mode: str, seed: int) -> TorchBackend:
    cfg, _ = load_config(None, [f"model.path={model_dir}", "data.path=unused.parquet", "lora.rank=4", "lora.alpha=8",
                                f"lora.syncMode={mode}", f"lora.targetModules={GDN_TARGETS}"])
    b = TorchBackend(cfg, device="cpu", threads=1)
    randomize_adapter(b, seed)
    return b


def synced_gap(engine, b: TorchBackend, lora_path: str | None) -> float:
    with engine.client() as client:
        sender = WeightSender(b.model, b.cfg, DistributedTransport.connect([client], backend="gloo"))
        try:
            assert sender.sync(version=1).pushed
            return logprob_gap(client, b, lora_path)
        finally:
            sender.close()


def gate_b(b: TorchBackend) -> list[torch.Tensor]:
    return [m.lora_B.weight for n, m in b.model.named_modules() if n.endswith(("in_proj_b", "in_proj_a"))
            and hasattr(m, "lora_B")]


def test_adapter_mode_pins_the_gates_and_the_engine_serves_the_trained_policy(engine, gdn_dir):
    b = gdn_policy(gdn_dir, "Adapter", seed=1)
    assert len(b.gate_pinned) == 4  # in_proj_b and in_proj_a of both GDN layers
    assert all(not w.any() for w in gate_b(b))
    with engine.client() as client:
        sender = WeightSender(b.model, b.cfg, DistributedTransport.connect([client], backend="gloo"))
        try:
            # SGLang's names: in_proj_qkvz for HF's in_proj_qkv + in_proj_z, no in_proj_ba on the stock build
            assert set(sender.adapter_config["target_modules"]) == {"in_proj_qkvz", "out_proj", "q_proj", "k_proj",
                                                                    "v_proj", "o_proj"}
            pushed = sender.served_adapter_source().names
            assert any(".in_proj_q.lora_A" in n for n in pushed) and not any("in_proj_qkv." in n for n in pushed)
            assert not any(".in_proj_b." in n or ".in_proj_a." in n for n in pushed)
            assert sender.sync(version=1).pushed
            assert logprob_gap(client, b, POLICY_ADAPTER) < ATOL
            # a training step later (the pinned rows still zero), the next push still serves the policy
            with torch.no_grad():
                for p in b.params:
                    p.add_(0.05)
            pin_gate_rows(b.model)
            assert logprob_gap(client, b, POLICY_ADAPTER) > VISIBLE  # stale until pushed
            assert sender.sync(version=2).what == "adapter"
            assert logprob_gap(client, b, POLICY_ADAPTER) < ATOL
        finally:
            sender.close()


def test_with_the_gate_pin_off_the_unserved_gates_show_as_a_gap(engine, gdn_dir, monkeypatch):
    monkeypatch.setenv(GATE_MASK_OFF_ENV, "1")
    b = gdn_policy(gdn_dir, "Adapter", seed=2)
    assert b.gate_pinned == [] and all(w.any() for w in gate_b(b))
    assert synced_gap(engine, b, POLICY_ADAPTER) > VISIBLE


def test_merge_mode_folds_the_gates_too(engine, gdn_dir):
    b = gdn_policy(gdn_dir, "Merge", seed=3)
    assert b.gate_pinned == [] and all(w.any() for w in gate_b(b))  # nothing pinned: the unmasked policy
    assert synced_gap(engine, b, None) < ATOL


@pytest.mark.parametrize("mode", ["Adapter", "Merge"])
def test_the_gdn_export_loads_with_peft_and_merges(gdn_dir, tmp_path, mode):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    b = gdn_policy(gdn_dir, mode, seed=4)
    tensors, config, _ = b.peft_export()
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"} <= set(config["target_modules"])
    out = export_peft(tmp_path, tensors, config, {"step": 1, "sync_mode": mode})
    ids = torch.tensor([[1, 4, 5, 13, 6, 7, 14, 3, 9]])
    with torch.no_grad():
        want = b.model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(gdn_dir, dtype=torch.float32)
        got = PeftModel.from_pretrained(base, out)(input_ids=ids).logits
        merge(gdn_dir, out, tmp_path / "merged", progress=False)  # `kora merge`: the GDN pairs fold by HF name
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5
    assert (merged - want).abs().max() < 1e-5


def test_the_engine_serves_an_adapter_mode_export_and_refuses_live_gates(engine, gdn_dir, tmp_path):
    """As the stock build the engine cannot serve a gate adapter: one that would change the policy is refused (400,
    naming the modules), never silently dropped (sgl-project/sglang #30499); an Adapter-mode export's pinned, all-zero
    gates add nothing and load."""
    pinned = gdn_policy(gdn_dir, "Adapter", seed=5)
    live = gdn_policy(gdn_dir, "Merge", seed=6)
    with engine.client() as client:
        sender = WeightSender(pinned.model, pinned.cfg, DistributedTransport.connect([client], backend="gloo"))
        try:
            sender.sync(version=1)  # the base these adapters were trained on (an earlier test may have merged)
        finally:
            sender.close()
        for name, b in (("gdn-pinned", pinned), ("gdn-live", live)):
            tensors, config, _ = b.peft_export()
            export_peft(tmp_path / name, tensors, config, {"step": 1})
        client.load_lora_adapter("gdn-pinned", str(tmp_path / "gdn-pinned" / "lora_adapter"))
        assert logprob_gap(client, pinned, "gdn-pinned") < ATOL
        with pytest.raises(EngineError) as refused:
            client.load_lora_adapter("gdn-live", str(tmp_path / "gdn-live" / "lora_adapter"))
        assert refused.value.status == 400
        assert "in_proj_b" in refused.value.message and "carries no LoRA on GDN gate" in refused.value.message


def test_a_multi_lora_publish_of_a_gdn_adapter_goes_out_under_sglang_names(engine, gdn_dir):
    """sync/slot_sender.SlotSender (multi-LoRA: Adapter mode, so the gates are pinned) pushes a named adapter under
    the same names as the single-adapter push, and the engine serves it."""
    from kora_trainer.lora import peft_config_dict
    from kora_trainer.sync.slot_sender import SlotSender

    b = gdn_policy(gdn_dir, "Adapter", seed=7)
    with engine.client() as client:
        sender = SlotSender(b.model, b.cfg, DistributedTransport.connect([client], backend="gloo"))
        try:
            sender.push_base()
            assert sender.publish("gdn-a", 1, peft_config_dict(b.model, b.cfg.lora, str(gdn_dir))).pushed
            assert "in_proj_qkvz" in sender.adapter_config["target_modules"]
            assert logprob_gap(client, b, "gdn-a") < ATOL
        finally:
            sender.close()
