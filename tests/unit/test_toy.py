"""The toy task: model, tokenizer and dataset written by `kora make-toy`, loaded by the real loaders."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kora_trainer.toys.lm import VOCAB, encode_batch, make_toy, sampled_accuracy


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    info = make_toy(out, target=0.0)  # no pretraining: the layout, not the skill, is under test
    assert info["pretrain"]["steps"] == 0 and info["rows"] == 10_000
    return out


def test_loads_with_auto_classes(toy_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(toy_dir)
    tok = AutoTokenizer.from_pretrained(toy_dir)
    cfg = model.config
    assert cfg.model_type == "qwen3"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 128, 512)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, 16)
    assert 480_000 < sum(p.numel() for p in model.parameters()) < 510_000
    ids = tok("07+45=")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "0", "7", "+", "4", "5", "="]
    assert tok.decode([VOCAB.index("0"), VOCAB.index("5"), VOCAB.index("2"), tok.eos_token_id],
                      skip_special_tokens=True) == "052"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)  # as tests/tinymodel.py


def test_dataset_holds_every_sum(toy_dir):
    import pyarrow.parquet as pq

    rows = pq.read_table(toy_dir / "train.parquet").to_pylist()
    assert len(rows) == 10_000
    assert {"prompt": "07+45=", "label": "052"} in rows and {"prompt": "99+99=", "label": "198"} in rows


def test_encoding_matches_the_tokenizer(toy_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_dir)
    ids = encode_batch(torch.tensor([7]), torch.tensor([45]))[0].tolist()
    assert ids == tok("07+45=052")["input_ids"] + [tok.eos_token_id]


def test_untrained_model_cannot_add(toy_dir):
    from transformers import AutoModelForCausalLM

    assert sampled_accuracy(AutoModelForCausalLM.from_pretrained(toy_dir).eval(), n=200) < 0.05


def test_make_toy_is_a_kora_command():
    out = subprocess.run([sys.executable, "-m", "kora_cli.main", "make-toy", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "DIR" in out.stdout
