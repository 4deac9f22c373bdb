"""Vision-language prompts (docs/vl.md): the dataset's image cells, the prompt ids with their placeholders, the
reference engine serving `image_data` on `/generate` as a real process on 127.0.0.1, and the trainer's log-probs
of the same samples (the serving check's two sides) on the VL toy (tests/conftest.py `vl_toy_dir`)."""

from __future__ import annotations

import json

import pytest
import torch

from engine_helpers import start_engine, stop_engine
from kora_trainer.config import LoRASpec
from kora_trainer.lora import apply_lora
from kora_trainer.orchestration.data import load_rows
from kora_trainer.wire.engine_client import EngineError
from kora_trainer.wire.vision import (
    VisionTokens,
    expand_placeholders,
    image_item,
    images_from_bytes,
    load_image_processor,
    load_policy_model,
    prompt_ids,
)

pytestmark = pytest.mark.timeout(240)
TOKENS = VisionTokens(image=5, start=3, end=4, merge=2)
ATOL = 1e-4


def test_placeholders_expand_to_each_images_tokens_and_a_wrong_count_is_refused():
    assert expand_placeholders([1, 3, 5, 4, 9], TOKENS, [4]) == [1, 3, 5, 5, 5, 5, 4, 9]
    assert expand_placeholders([1, 3, 5, 5, 5, 5, 4], TOKENS, [4]) == [1, 3, 5, 5, 5, 5, 4]  # already expanded
    assert expand_placeholders([3, 5, 4, 3, 5, 4], TOKENS, [1, 2]) == [3, 5, 4, 3, 5, 5, 4]
    for ids, counts, words in (([3, 5, 5, 4], [4], "2 placeholder tokens"), ([3, 5, 4], [4, 4], "1 image placeholders"),
                               ([3, 5, 4, 5], [4], "more image placeholders")):
        with pytest.raises(ValueError, match=words):
            expand_placeholders(ids, TOKENS, counts)


def test_rows_read_images_from_parquet_bytes_and_jsonl_paths(vl_toy_dir, tmp_path):
    parquet = load_rows(str(vl_toy_dir / "train.parquet"), "prompt", "label", "image")
    jsonl = load_rows(str(vl_toy_dir / "train.jsonl"), "prompt", "label", "image")
    assert len(parquet) == len(jsonl) == 512
    assert [(r.prompt, r.label, r.images) for r in parquet] == [(r.prompt, r.label, r.images) for r in jsonl]
    assert parquet[0].images[0][:4] == b"\x89PNG"
    assert load_rows(str(vl_toy_dir / "train.parquet"), "prompt", "label")[0].images == ()  # no imageKey: text
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "label": "1", "image": "missing.png"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0: image 'missing.png' is not a file"):
        load_rows(str(bad), "prompt", "label", "image")


def test_scope_picks_the_language_model_the_vision_tower_or_both(vl_toy_dir):
    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    wrapped = {}
    for scope in ("all", "language", "vision"):
        model = load_policy_model(str(vl_toy_dir))
        wrapped[scope] = set(apply_lora(model, LoRASpec(rank=2, target_modules=targets, scope=scope)))
    vision = {n for n in wrapped["all"] if n.startswith("model.visual.")}
    assert vision == {"model.visual.blocks.0.attn.qkv", "model.visual.blocks.0.attn.proj",
                      "model.visual.blocks.0.mlp.linear_fc1", "model.visual.blocks.0.mlp.linear_fc2",
                      "model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2"}
    assert wrapped["vision"] == vision and wrapped["language"] == wrapped["all"] - vision
    assert "model.language_model.layers.1.self_attn.q_proj" in wrapped["language"]


@pytest.fixture(scope="module")
def engine(vl_toy_dir, tmp_path_factory):
    proc = start_engine(vl_toy_dir, tmp_path_factory.mktemp("vl_engine"))
    yield proc
    stop_engine(proc)


def _prompts(vl_toy_dir, rows):
    from transformers import AutoTokenizer

    tok, proc = AutoTokenizer.from_pretrained(vl_toy_dir), load_image_processor(str(vl_toy_dir))
    tokens = VisionTokens.of(load_policy_model(str(vl_toy_dir)).config)
    images = [images_from_bytes(proc, r.images) for r in rows]
    return [prompt_ids(tok, tokens, r.prompt, im) for r, im in zip(rows, images, strict=True)], images


def test_the_engine_serves_image_prompts_and_its_logprobs_are_the_trainers(vl_toy_dir, engine):
    from kora_trainer.backends.batch import pad
    from kora_trainer.backends.logprobs import sequence_logp

    rows = load_rows(str(vl_toy_dir / "train.parquet"), "prompt", "label", "image")[::64]  # one of each colour
    ids, images = _prompts(vl_toy_dir, rows)
    with engine.client() as c:
        info = c.model_info()
        greedy = c.generate(ids, {"max_new_tokens": 2, "temperature": 0.0},
                            image_data=[[image_item(b) for b in r.images] for r in rows])
        # sampled at T=2, 6 tokens past <eos>, each sample its own sampling_seed, <|image_pad|> favoured by a
        # logit_bias (log-probs are the raw model's: the bias only steers the draw): responses of every kind,
        # sampled <|image_pad|> tokens among them on every run
        sampled = c.generate(ids * 4, [{"max_new_tokens": 6, "temperature": 2.0, "ignore_eos": True,
                                        "logit_bias": {str(TOKENS.image): 4.0}, "sampling_seed": seed}
                                       for seed in range(4 * len(ids))],
                             image_data=[[image_item(b) for b in r.images] for r in rows] * 4)
    assert info["has_image_understanding"] is True
    # the pretrained toy reads every colour greedily (toys/vl.py: toy.json's greedy_accuracy)
    assert [o.text for o in greedy] == [r.label for r in rows]
    assert any(TOKENS.image in o.output_ids for o in sampled)
    model = load_policy_model(str(vl_toy_dir)).eval()
    outs = [*greedy, *sampled]
    p = pad(ids + ids * 4, [o.output_ids for o in outs], [o.output_logprobs for o in outs], 0, images + images * 4)
    with torch.no_grad():
        ours = sequence_logp(model, p, 0)  # [B, R]
    gap = float(((ours - p.rollout_logp).abs() * p.response_mask).max())
    assert gap < ATOL, gap


def test_image_data_the_engine_cannot_use_is_refused_naming_the_field(vl_toy_dir, engine):
    rows = load_rows(str(vl_toy_dir / "train.parquet"), "prompt", "label", "image")[:1]
    ids, _ = _prompts(vl_toy_dir, rows)
    item = image_item(rows[0].images[0])
    cases = [({"image_data": [["not base64!"]]}, "image_data: not a base64-encoded image"),
             ({"image_data": [[item, item]]}, "image placeholders for 2 images"),
             ({"image_data": [[item], [item]]}, "a batch of 1 prompts takes a list of 1 entries")]
    with engine.client() as c:
        for extra, words in cases:
            with pytest.raises(EngineError, match=words) as e:
                c.generate(ids, {"max_new_tokens": 1}, **extra)
            assert e.value.status == 400
        # no image for a prompt that holds a placeholder: the expanded ids go as text tokens, as SGLang takes them
        assert len(c.generate([[1, 19, 31]], {"max_new_tokens": 1})[0].output_ids) == 1


def test_a_text_model_refuses_image_data(tmp_path):
    from tinymodel import make_tiny_model

    text = start_engine(make_tiny_model(tmp_path / "tiny"), tmp_path)
    try:
        with text.client() as c, pytest.raises(EngineError, match="image_data: this engine's model has no vision"):
            c.generate([[1, 4, 5]], {"max_new_tokens": 1}, image_data=[[image_item(b"x")]])
    finally:
        stop_engine(text)
