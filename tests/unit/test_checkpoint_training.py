"""The train loop's checkpoint contents (checkpoint/training.py) on the real torch backend: a backend
restored from step k continues bit for bit like the one that never stopped (adapter, AdamW, dropout RNG,
minibatch shuffle, version); what does not fit is refused; rule 8; the HF-PEFT export's names and meta;
and the rollout manager's per-sample seeds (orchestration/rollout_manager.py)."""

from __future__ import annotations

import json

import pytest
import torch

from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.backends.torch_backend import TorchBackend
from kora_trainer.checkpoint.lora_only import CheckpointError
from kora_trainer.checkpoint.training import (
    export_adapter,
    restore_training_state,
    save_training_state,
)
from kora_trainer.config import load_config
from kora_trainer.lora import adapter_tensors
from kora_trainer.orchestration.data import Row, batches
from kora_trainer.orchestration.rollout_manager import SEED_MASK, sampling_seed
from tinymodel import make_tiny_model

PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 9, 13, 3, 14]]
RESPONSES = [[5, 6, 7, 2], [8, 8, 8, 2], [5, 6, 2], [9, 2], [3, 3, 2], [4, 5, 6, 2], [12, 2], [7, 2]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def backend(model_dir, **over) -> TorchBackend:
    overrides = [f"model.path={model_dir}", "data.path=unused.parquet", "lora.rank=4", "lora.alpha=8",
                 "lora.dropout=0.2", "lora.syncMode=Merge", "algorithm.lr=0.02", "algorithm.innerEpochs=2",
                 "algorithm.globalBatchSize=4", "algorithm.nSamplesPerPrompt=4",
                 *[f"{k}={v}" for k, v in over.items()]]
    cfg, _ = load_config(None, overrides)
    return TorchBackend(cfg, device="cpu", threads=1)


def batch(b: TorchBackend, step: int) -> RolloutBatch:
    """A step's rollouts: 2 prompts x 4 responses, log-probs from the policy, rewards varying by step."""
    prompts = [p for p in PROMPTS for _ in range(4)]
    logp = b.logprobs(prompts, RESPONSES)
    rewards = [float((i * 7 + step) % 3 == 0) for i in range(len(RESPONSES))]
    return RolloutBatch(prompts, RESPONSES, logp, rewards, 4, [str(b.version)] * len(RESPONSES))


def adapter(b: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in adapter_tensors(b.model)}


def test_a_restored_backend_continues_exactly(model_dir, tmp_path):
    straight = backend(model_dir)
    losses = [straight.train_step(batch(straight, s)).loss for s in (1, 2)]
    saved = save_training_state(tmp_path, straight, data_position=2, keep=2, meta={"sync_mode": "Merge"})
    assert saved.name == "step_00000002"
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["step"] == 2 and meta["data_position"] == 2 and meta["sync_mode"] == "Merge"
    assert meta["param_names"] == [n for n, _ in adapter_tensors(straight.model)]
    losses += [straight.train_step(batch(straight, s)).loss for s in (3, 4)]

    torch.manual_seed(999)  # a fresh process: other global RNG state, a freshly initialised adapter
    resumed = backend(model_dir)
    info = restore_training_state(tmp_path, resumed)
    assert info is not None and (info.step, info.data_position, info.skipped) == (2, 2, [])
    assert info.path == str(saved) and resumed.version == 2
    tail = [resumed.train_step(batch(resumed, s)).loss for s in (3, 4)]
    assert tail == losses[2:]  # equal floats: dropout masks, shuffles and AdamW moments all continued
    want, got = adapter(straight), adapter(resumed)
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_nothing_to_resume_from_and_what_does_not_fit(model_dir, tmp_path):
    b = backend(model_dir)
    assert restore_training_state(tmp_path / "none", b) is None
    save_training_state(tmp_path, b, data_position=0, keep=2)
    with pytest.raises(CheckpointError, match=r"lora.rank changed"):
        restore_training_state(tmp_path, backend(model_dir, **{"lora.rank": 8}))
    with pytest.raises(CheckpointError, match=r"lora.targetModules"):
        restore_training_state(tmp_path, backend(model_dir, **{"lora.targetModules": "[linear_qkv]"}))


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(model_dir, tmp_path):
    b = backend(model_dir)
    b.train_step(batch(b, 1))
    save_training_state(tmp_path, b, data_position=1, keep=2)
    b.train_step(batch(b, 2))
    newest = save_training_state(tmp_path, b, data_position=2, keep=2)
    (newest / "trainer_state.pt").write_bytes(b"torn")
    other = backend(model_dir)
    info = restore_training_state(tmp_path, other)
    assert info is not None and info.step == 1 and other.version == 1
    assert len(info.skipped) == 1 and "step_00000002: trainer_state.pt fails its checksum" in info.skipped[0]


def test_rule8_only_lora_parameters_may_train(model_dir):
    b = backend(model_dir)
    b.check_lora_only()
    b.model.model.norm.weight.requires_grad_(True)
    with pytest.raises(CheckpointError, match=r"checkpoint.loraOnly.*model.norm.weight"):
        b.check_lora_only()


def test_export_names_config_and_meta(model_dir, tmp_path):
    b = backend(model_dir)
    b.train_step(batch(b, 1))
    out = export_adapter(tmp_path, b, b.cfg, {"seed": 7})
    assert out == tmp_path / "lora_adapter"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir.resolve())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["lora_dropout"] == 0.2
    meta = json.loads((out / "kora_lora_meta.json").read_text())
    assert meta["step"] == 1 and meta["sync_mode"] == "Merge" and meta["seed"] == 7
    assert meta["module_map"] == {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"]}
    assert meta["base_model"] == str(model_dir.resolve()) and len(meta["modules"]) == 8  # 2 layers x q,k,v,o
    assert oct(out.stat().st_mode & 0o777) == "0o755"


def test_sampling_seeds_are_per_sample_and_per_step():
    seeds = {(s, p, j): sampling_seed(1234, s, p, j) for s in (1, 2) for p in range(8) for j in range(4)}
    assert len(set(seeds.values())) == len(seeds)  # every sample of every step draws on its own
    assert all(0 <= v <= SEED_MASK for v in seeds.values())  # fits SGLang's int32 seed tensor
    assert sampling_seed(1234, 2, 3, 1) == seeds[(2, 3, 1)]  # a pure function: a resumed run repeats it
    assert sampling_seed(99, 2, 3, 1) != seeds[(2, 3, 1)]


def test_the_rollout_manager_fast_forwards_to_a_data_position(model_dir, tmp_path):
    from kora_trainer.orchestration.rollout_manager import Rollout

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(10)))
    cfg, _ = load_config(None, [f"model.path={model_dir}", f"data.path={data}", "data.inputKey=prompt",
                                "data.labelKey=label", "algorithm.rolloutBatchSize=3", "lora.rank=4"])
    straight = batches([Row(i, f"{i}+1=", str(i + 1)) for i in range(10)], 3, cfg.algorithm.seed)
    first = [next(straight) for _ in range(7)]  # crosses epoch boundaries (3 batches per epoch)
    rollout = Rollout(cfg, ["http://127.0.0.1:9"])  # no engine is contacted: only the prompt iterator is used
    try:
        assert rollout.position == 0 and rollout.skip_to(4) == 4 and rollout.position == 4
        assert [next(rollout._batches) for _ in range(3)] == first[4:]
        with pytest.raises(ValueError, match="cannot rewind"):
            rollout.skip_to(2)
    finally:
        rollout.close()
