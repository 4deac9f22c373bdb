"""The megatron backend on one GPU (TP = 1, a real NCCL process group of size 1, megatron parallel_state):
Qwen3 GPTModel from the tiny HF checkpoint, LoRA wrappers, HF / PEFT conversions, a GRPO step vs the torch backend.

Run on a GPU machine with megatron-core importable:
    PYTHONPATH=trainer:engine:tests:/path/to/megatron-core pytest -m gpu tests/gpu/test_megatron_model.py
Tolerances (fp32, TF32 off): logits 1e-4 absolute; bf16: megatron's error against the fp32 HF model at most
twice HF-bf16's own error (plus 1e-2). Numbers measured are in docs/megatron_backend.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kora_trainer.backends.megatron import megatron_available
from kora_trainer.backends.megatron.convert import (
    FC1,
    PEFT_PREFIX,
    QKV,
    Layout,
    adapter_modules,
    column_parallel,
    layout_from_hf_config,
)
from kora_trainer.config import LoRASpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not megatron_available(), reason="needs megatron-core (GPU-only; see docs/megatron_backend.md)"),
]
R, ALPHA = 4, 8.0
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
FP32_ATOL = 1e-4
REPORT = os.environ.get("KORA_MEGATRON_REPORT")  # a JSON-lines file the measured numbers are appended to


def report(**kw: object) -> None:
    print(json.dumps(kw))
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(kw) + "\n")


# ---- helpers (also used by test_megatron_tp.py) ----------------------------------------------------------

def make_tied(src: Path, dst: Path) -> Path:
    """The tiny checkpoint with tie_word_embeddings=True (lm_head = embed_tokens)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(src)
    cfg.tie_word_embeddings = True
    untied = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tied = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {k: v for k, v in untied.state_dict().items() if k != "lm_head.weight"}
    tied.load_state_dict(state, strict=False)
    tied.tie_weights()
    tied.save_pretrained(dst)
    return dst


def batch_ids(vocab: int, device: torch.device | str, seed: int = 0, shape: tuple[int, int] = (3, 11)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g).to(device)  # [B, L]


def hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def megatron_model(model_dir: Path, dtype: torch.dtype, lora: LoRASpec | None = None, seed: int = 0):
    from transformers import AutoConfig

    from kora_trainer.backends.megatron.lora import apply_lora
    from kora_trainer.backends.megatron.model import build_gpt_model, load_hf_state, read_hf_state

    cfg = AutoConfig.from_pretrained(model_dir)
    layout = layout_from_hf_config(cfg)
    model = build_gpt_model(cfg, dtype)
    if lora is not None:
        apply_lora(model, lora, seed=seed)
    load_hf_state(model, read_hf_state(model_dir), layout)
    return model.eval(), layout, cfg


def mg_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    return model(ids, pos, None).float()  # [B, L, V] (TP = 1: the whole vocabulary)


def spec(targets: list[str] = TARGETS, rank: int = R, alpha: float = ALPHA, dropout: float = 0.0) -> LoRASpec:
    return LoRASpec.model_validate({"rank": rank, "alpha": alpha, "dropout": dropout, "targetModules": targets})


def random_hf_adapter(layout: Layout, cfg, targets: list[str] = TARGETS, rank: int = R, seed: int = 1,
                      std: float = 0.2) -> dict[str, torch.Tensor]:
    """A random HF-PEFT adapter a fused megatron LoRA can hold: q/k/v share one A, gate/up share one A."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, layout.head_dim
    sizes = {"q_proj": (hidden, layout.num_heads * d), "k_proj": (hidden, layout.num_kv_heads * d),
             "v_proj": (hidden, layout.num_kv_heads * d), "o_proj": (layout.num_heads * d, hidden),
             "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    for hf_modules, _ in adapter_modules(layout, targets).values():
        a_in = sizes[hf_modules[0].rsplit(".", 1)[-1]][0]
        a = torch.randn(rank, a_in, generator=g) * std
        for m in hf_modules:
            out[f"{PEFT_PREFIX}{m}.lora_A.weight"] = a.clone()
            out[f"{PEFT_PREFIX}{m}.lora_B.weight"] = torch.randn(sizes[m.rsplit('.', 1)[-1]][1], rank,
                                                                  generator=g) * std
    return out


def peft_reference(model_dir: Path, adapter: dict[str, torch.Tensor], device, targets: list[str] = TARGETS,
                   rank: int = R, alpha: float = ALPHA):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from kora_trainer.lora import hf_leaf_names

    model = get_peft_model(hf_model(model_dir, torch.float32, device),
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules=hf_leaf_names(targets)))
    result = set_peft_model_state_dict(model, {k: v.to(device) for k, v in adapter.items()})
    assert not result.unexpected_keys, result.unexpected_keys
    return model.eval()


def megatron_grads_as_hf(model, layout: Layout) -> dict[str, torch.Tensor]:
    """The LoRA gradients under HF-PEFT names (a fused A's gradient listed under each projection)."""
    from kora_trainer.backends.megatron.convert import adapter_to_hf
    from kora_trainer.backends.megatron.export import _targets
    from kora_trainer.backends.megatron.lora import lora_modules
    from kora_trainer.backends.megatron.parallel import gather_tp

    mapping = adapter_modules(layout, _targets(model))
    out: dict[str, torch.Tensor] = {}
    for name, m in lora_modules(model).items():
        hf_modules, kind = mapping[name]
        ga, gb = m.lora_A.weight.grad, m.lora_B.weight.grad
        a_sh, b_sh = ([ga], gather_tp(gb)) if column_parallel(kind) else (gather_tp(ga), [gb])
        out.update(adapter_to_hf(hf_modules, kind, a_sh, b_sh, layout))
    return out


def peft_grads_fused(peft_model, layout: Layout, targets: list[str] = TARGETS) -> dict[str, torch.Tensor]:
    """PEFT's gradients with the A-gradients of fused projections summed (what a shared A receives)."""
    grads = {f"{PEFT_PREFIX}{n.removeprefix('base_model.model.').replace('.default', '')}": p.grad
             for n, p in peft_model.named_parameters() if p.grad is not None}
    out = dict(grads)
    for hf_modules, kind in adapter_modules(layout, targets).values():
        if kind in (QKV, FC1):
            total = sum(grads[f"{PEFT_PREFIX}{m}.lora_A.weight"] for m in hf_modules)
            for m in hf_modules:
                out[f"{PEFT_PREFIX}{m}.lora_A.weight"] = total
    return out


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


# ---- fixtures ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _megatron_tp1(parallel):  # every test here runs on megatron at TP = 1 (tests/gpu/conftest.py)
    yield


@pytest.fixture(scope="module")
def tied_dir(model_dir, tmp_path_factory):
    return make_tied(model_dir, tmp_path_factory.mktemp("tied"))


# ---- 1. the base model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_equal_hf_fp32(model_dir, tied_dir, tied):
    path = tied_dir if tied else model_dir
    model, layout, cfg = megatron_model(path, torch.float32)
    assert layout.tied is tied and layout.num_kv_heads < layout.num_heads  # GQA
    ids = batch_ids(cfg.vocab_size, "cuda")
    with torch.no_grad():
        got, want = mg_logits(model, ids), hf_model(path, torch.float32, "cuda")(input_ids=ids).logits.float()
    err = float((got - want).abs().max())
    report(test="logits_fp32", tied=tied, max_abs=err, logit_scale=float(want.abs().max()))
    assert err < FP32_ATOL


def test_logits_equal_hf_bf16(model_dir):
    model, _, cfg = megatron_model(model_dir, torch.bfloat16)
    ids = batch_ids(cfg.vocab_size, "cuda")
    with torch.no_grad():
        ref = hf_model(model_dir, torch.float32, "cuda")(input_ids=ids).logits.float()
        hf16 = hf_model(model_dir, torch.bfloat16, "cuda")(input_ids=ids).logits.float()
        got = mg_logits(model, ids)
    err_mg, err_hf = float((got - ref).abs().max()), float((hf16 - ref).abs().max())
    vs_hf16 = float((got - hf16).abs().max())
    report(test="logits_bf16", megatron_vs_fp32=err_mg, hf_bf16_vs_fp32=err_hf, megatron_vs_hf_bf16=vs_hf16,
           logit_scale=float(ref.abs().max()))
    assert err_mg <= 2 * err_hf + 1e-2


def test_base_exports_to_hf_names_unchanged(model_dir):
    from kora_trainer.backends.megatron.model import hf_state, read_hf_state

    model, layout, _ = megatron_model(model_dir, torch.float32)
    want = read_hf_state(model_dir)
    got = dict(hf_state(model, layout))
    assert set(got) == set(want)
    assert all(torch.equal(got[k].cpu(), want[k]) for k in want)
    assert set(dict(hf_state(model, layout, flavour="sglang"))) == set(want)  # dense Qwen3: SGLang reads HF names


# ---- 2. LoRA ----------------------------------------------------------------------------------------------

def test_lora_starts_at_the_base_and_only_adapters_train(model_dir):
    from kora_trainer.backends.megatron.lora import (
        LoRAColumnParallelLinear,
        LoRARowParallelLinear,
        adapter_disabled,
        adapter_parameters,
        check_only_adapters_trainable,
        lora_modules,
    )

    model, layout, cfg = megatron_model(model_dir, torch.float32, spec(dropout=0.1))
    mods = lora_modules(model)
    assert len(mods) == 4 * layout.num_layers
    kinds = {n.rsplit(".", 1)[-1]: type(m) for n, m in mods.items()}
    assert kinds == {"linear_qkv": LoRAColumnParallelLinear, "linear_fc1": LoRAColumnParallelLinear,
                     "linear_proj": LoRARowParallelLinear, "linear_fc2": LoRARowParallelLinear}
    check_only_adapters_trainable(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == sum(p.numel() for p in adapter_parameters(model))
    for m in mods.values():
        assert m.scaling == ALPHA / R and float(m.lora_B.weight.abs().max()) == 0.0
        assert float(m.lora_A.weight.abs().max()) > 0 and isinstance(m.dropout, torch.nn.Dropout)
    ids = batch_ids(cfg.vocab_size, "cuda")
    with torch.no_grad():
        on = mg_logits(model, ids)
        with adapter_disabled(model):
            off = mg_logits(model, ids)
    assert torch.equal(on, off)  # B = 0: the adapter starts as the identity change


def test_lora_logits_equal_peft_and_the_adapter_round_trips(model_dir, tmp_path):
    from peft import PeftModel

    from kora_trainer.backends.megatron.export import export_hf_peft, hf_adapter_tensors, load_hf_adapter
    from kora_trainer.backends.megatron.lora import adapter_disabled
    from kora_trainer.backends.megatron.model import hf_state

    model, layout, cfg = megatron_model(model_dir, torch.float32, spec())
    adapter = random_hf_adapter(layout, cfg)
    load_hf_adapter(model, adapter, layout)
    ids = batch_ids(cfg.vocab_size, "cuda")
    ref = peft_reference(model_dir, adapter, "cuda")
    with torch.no_grad():
        got, want = mg_logits(model, ids), ref(input_ids=ids).logits.float()
        with adapter_disabled(model):
            base_got = mg_logits(model, ids)
        base_want = hf_model(model_dir, torch.float32, "cuda")(input_ids=ids).logits.float()
    lora_err, base_err = float((got - want).abs().max()), float((base_got - base_want).abs().max())
    shift = float((want - base_want).abs().max())
    report(test="lora_vs_peft_fp32", max_abs=lora_err, adapter_off_max_abs=base_err, adapter_effect=shift)
    assert shift > 0.1  # the adapter really changes the policy
    assert lora_err < FP32_ATOL and base_err < FP32_ATOL

    # megatron -> HF-PEFT names is the exact inverse of HF-PEFT -> megatron
    exported = hf_adapter_tensors(model, layout)
    assert set(exported) == set(adapter)
    assert all(torch.equal(exported[k].cpu(), adapter[k]) for k in adapter)
    # the HF-PEFT directory loads in peft with the same logits
    out = export_hf_peft(model, layout, spec(), str(model_dir), tmp_path, meta={"step": 0})
    assert out is not None
    loaded = PeftModel.from_pretrained(hf_model(model_dir, torch.float32, "cuda"), out).eval()
    with torch.no_grad():
        peft_err = float((loaded(input_ids=ids).logits.float() - got).abs().max())
    # a second megatron policy, built with another seed, takes the adapter back and exports the same tensors
    other, _, _ = megatron_model(model_dir, torch.float32, spec(), seed=7)
    load_hf_adapter(other, exported, layout)
    again = hf_adapter_tensors(other, layout)
    assert all(torch.equal(again[k], exported[k]) for k in exported)
    # Merge mode: the folded model under HF names is a plain HF model with the same logits
    plain = hf_model(model_dir, torch.float32, "cuda")
    plain.load_state_dict({k: v for k, v in hf_state(model, layout, merged=True)}, strict=True)
    with torch.no_grad():
        merged_err = float((plain(input_ids=ids).logits.float() - got).abs().max())
    report(test="lora_export_fp32", peft_dir_max_abs=peft_err, merged_max_abs=merged_err)
    assert peft_err < FP32_ATOL and merged_err < FP32_ATOL


def test_lora_gradients_equal_peft(model_dir):
    from kora_trainer.backends.megatron.backend import token_logprobs
    from kora_trainer.backends.megatron.export import load_hf_adapter

    model, layout, cfg = megatron_model(model_dir, torch.float32, spec())
    adapter = random_hf_adapter(layout, cfg)
    load_hf_adapter(model, adapter, layout)
    ref = peft_reference(model_dir, adapter, "cuda")
    ids = batch_ids(cfg.vocab_size, "cuda")
    token_logprobs(model, ids).sum().backward()
    logp = torch.log_softmax(ref(input_ids=ids).logits[:, :-1].float(), -1)
    logp.gather(-1, ids[:, 1:].unsqueeze(-1)).sum().backward()
    got, want = megatron_grads_as_hf(model, layout), peft_grads_fused(ref, layout)
    assert set(got) == set(adapter)
    worst = max(max_rel(got[k], want[k]) for k in got)
    report(test="lora_grads_vs_peft_fp32", max_rel=worst)
    assert worst < 1e-4


# ---- 3. a GRPO step against the torch backend ------------------------------------------------------------

PROMPT, RESPONSES, REWARDS = [1, 4, 5, 13, 6, 7, 14], [[5, 6, 7, 2], [8, 8, 8, 2], [5, 6, 2], [9, 3]], [1.0, 0, 1, 0]


def _cfg(model_dir: Path, targets: list[str], tensor: int = 1):
    from kora_trainer.config import load_config

    overrides = [f"model.path={model_dir}", "data.path=unused.parquet", f"lora.rank={R}", f"lora.alpha={ALPHA}",
                 "lora.syncMode=Merge", "algorithm.lr=0.01", "algorithm.innerEpochs=1", "algorithm.klCoef=0.05",
                 f"parallelism.tensor={tensor}"]
    cfg, _ = load_config(None, overrides, base={"lora": {"rank": R, "targetModules": targets}})
    return cfg


@pytest.mark.parametrize("targets", [["linear_proj", "linear_fc2"], TARGETS], ids=["unfused", "all"])
def test_grpo_steps_equal_the_torch_backend(model_dir, targets):
    from kora_trainer.backends.batch import RolloutBatch
    from kora_trainer.backends.megatron.backend import MegatronBackend
    from kora_trainer.backends.megatron.export import hf_adapter_tensors, load_hf_adapter
    from kora_trainer.backends.torch_backend import TorchBackend
    from kora_trainer.lora import lora_modules

    cfg = _cfg(model_dir, targets)
    mg = MegatronBackend(cfg, dtype=torch.float32)
    # the plain prompt+response forward: the shared-prefix path is a speed trick of the torch backend,
    # checked against the plain one by its own tests
    th = TorchBackend(cfg, device="cuda", shared_prefix=False)
    adapter = random_hf_adapter(mg.layout, mg.hf_config, targets, std=0.05)
    load_hf_adapter(mg.model, adapter, mg.layout)
    with torch.no_grad():  # the same adapter in the torch backend's LoRALinear modules (HF-PEFT names)
        for name, m in lora_modules(th.model).items():
            m.lora_A.weight.copy_(adapter[f"{PEFT_PREFIX}{name}.lora_A.weight"])
            m.lora_B.weight.copy_(adapter[f"{PEFT_PREFIX}{name}.lora_B.weight"])
    prompts, responses = [PROMPT] * len(RESPONSES), RESPONSES
    steps = []
    for step in range(3):
        old = th.logprobs(prompts, responses)
        old_mg = mg.logprobs(prompts, responses)
        lp_err = max(abs(x - y) for a, b in zip(old, old_mg, strict=True) for x, y in zip(a, b, strict=True))
        batch = RolloutBatch(prompts, responses, old, REWARDS, group_size=4)
        a, b = th.train_step(batch), mg.train_step(batch)
        steps.append({"step": step, "logprob_max_abs": lp_err, **{f"{k}_torch": getattr(a, k) for k in ("loss", "kl",
                      "grad_norm")}, **{f"{k}_megatron": getattr(b, k) for k in ("loss", "kl", "grad_norm")}})
        rel = 1e-4 if step == 0 else 2e-3  # later steps: AdamW amplifies fp32 rounding differences
        assert lp_err < (FP32_ATOL if step == 0 else 1e-3)
        assert abs(a.loss - b.loss) < 1e-5 + rel * abs(a.loss)
        assert abs(a.kl - b.kl) < 1e-6 + rel * abs(a.kl)
        if targets != TARGETS:  # unfused targets: the same parametrisation, so the same gradients
            assert abs(a.grad_norm - b.grad_norm) < rel * a.grad_norm
        else:  # a shared A trains differently after the first update; compare the first step only
            break
    report(test="grpo_vs_torch_backend_fp32", targets=targets, steps=steps)
    if targets != TARGETS:
        got = hf_adapter_tensors(mg.model, mg.layout)
        worst = max(max_rel(got[f"{PEFT_PREFIX}{n}.lora_{w}.weight"].cpu(),
                            getattr(m, f"lora_{w}").weight.detach().cpu())
                    for n, m in lora_modules(th.model).items() for w in "AB")
        report(test="grpo_adapter_after_3_steps", max_rel=worst)
        assert worst < 5e-3


def megatron_grpo_steps(model_dir: Path, targets: list[str], tensor: int = 1, steps: int = 3) -> list[dict]:
    """MegatronBackend (fp32) from the same random adapter, `steps` GRPO steps on the test batch: the metrics."""
    from kora_trainer.backends.batch import RolloutBatch
    from kora_trainer.backends.megatron.backend import MegatronBackend
    from kora_trainer.backends.megatron.export import load_hf_adapter

    mg = MegatronBackend(_cfg(model_dir, targets, tensor), dtype=torch.float32)
    load_hf_adapter(mg.model, random_hf_adapter(mg.layout, mg.hf_config, targets, std=0.05), mg.layout)
    prompts = [PROMPT] * len(RESPONSES)
    out = []
    for _ in range(steps):
        old = mg.logprobs(prompts, RESPONSES)
        m = mg.train_step(RolloutBatch(prompts, RESPONSES, old, REWARDS, group_size=4))
        kept = {k: getattr(m, k) for k in ("loss", "kl", "grad_norm", "ratio")}
        out.append(kept | {"logp": [x for r in old for x in r]})
    return out
