"""The vision-language toy: a tiny Qwen3.5 (GDN + attention layers, a one-block vision tower) that names the colour
of a generated image, just good enough to have room to learn (docs/vl.md).

`kora make-toy --vl DIR` writes, all loadable by the real loading code (`from_pretrained` on DIR):
  DIR/config.json, model.safetensors   Qwen3_5ForConditionalGeneration: text 2 layers (GDN, attention), hidden 64;
                                       vision 1 block, hidden 32, patch 8, merge 2 (a 32x32 image = 4 tokens)
  DIR/tokenizer.json, chat_template.jinja, ...   one token per character plus the Qwen-VL special tokens
  DIR/preprocessor_config.json         the Qwen2-VL image processor (the checkpoint's AutoImageProcessor)
  DIR/train.parquet                    columns prompt ("colour?"), image (PNG bytes), label ("0".."7")
  DIR/train.jsonl, DIR/images/*.png    the same rows with image paths (relative to the jsonl file)
  DIR/toy.json                         how it was made and the accuracy it starts with

Why no processor_config.json: transformers 5's Qwen3VLProcessor cannot be built without torchvision (its video
processor, and the class lookup of that attribute, need it), which this venv lacks. kora builds the prompt as the
processor does from its parts (the tokenizer's chat template, the image processor, the placeholder expansion:
wire/vision.py), so nothing here needs it.

Why Qwen3.5: it is the architecture of the recipes kora is measured against (issue 20), GDN layers and all; the text
part is the one docs/gdn.md trains. The task: 8 colours, each image a solid colour with a per-image brightness
jitter; the label is the colour's index. The prompt text is the same for every row, so only the image tells the
answer. Pretraining (next-token loss on the answer, whole model) stops at the first check whose sampled (T=1)
accuracy reaches `target` (chance is 1/8): GRPO then has signal and room.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import torch

from kora_trainer.wire.vision import ImageInputs, VisionTokens, forward_inputs, images_from_bytes, prompt_ids

SPECIAL = ["<pad>", "<bos>", "<eos>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB = [*SPECIAL, *"0123456789", *"abcdefghijklmnopqrstuvwxyz ?"]
VOCAB_SIZE = 48  # len(VOCAB) = 45, rounded up
PROMPT = "colour?"
SIDE = 32  # image side: 4x4 patches of 8 -> 2x2 merged tokens
# the 8 colours; label = index
PALETTE = [(230, 30, 30), (30, 200, 30), (30, 30, 230), (230, 230, 30), (30, 220, 220), (220, 30, 220),
           (240, 240, 240), (20, 20, 20)]
VARIANTS = 64  # jittered images per colour: 512 rows
CHAT_TEMPLATE = ("<bos>{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                 "{% endfor %}")
# Stop at 0.3 sampled accuracy (chance 0.125); checked every 5 steps on a fresh draw of 256 images.
PRETRAIN = {"target": 0.3, "check_every": 5, "max_steps": 600, "batch": 64, "lr": 3e-3, "seed": 0}


def make_tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 - tokenizers loads on use (toy making)
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - transformers is heavy: loaded on use

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|?[a-z_]+\|?>|."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<pad>",
        padding_side="left", clean_up_tokenization_spaces=False,
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_image_processor() -> Any:
    from transformers import Qwen2VLImageProcessorPil  # noqa: PLC0415 - transformers is heavy: loaded on use

    # min = max pixels: every image is resized to SIDE x SIDE, so every prompt has the same 4 image tokens
    return Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": SIDE * SIDE, "longest_edge": SIDE * SIDE})


def model_config() -> Any:
    from transformers import Qwen3_5Config  # noqa: PLC0415 - transformers is heavy: loaded on use

    ids = {t: VOCAB.index(t) for t in SPECIAL}
    text = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention", "full_attention"], max_position_embeddings=64,
                pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
                tie_word_embeddings=True,
                # rotary dim 8 (head 16 x 0.5) = 4 frequencies, split over time / height / width as Qwen3.5 does
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True, "partial_rotary_factor": 0.5})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16)
    return Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True, dtype="float32")


# The MoE variant (`kora make-toy --vl --moe`, issue 20 item 3): the same text shape with each layer's MLP swapped
# for transformers 5's fused 3-D experts + a bare router weight + a shared expert, as Qwen3.6-35B-A3B has them, so
# expert LoRA, the tower and GDN meet in one model. Everything else (tower, tokens, data) is the dense toy's.
MOE_TEXT = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                router_aux_loss_coef=0.0)


def moe_model_config() -> Any:
    from transformers import Qwen3_5MoeConfig  # noqa: PLC0415 - transformers is heavy: loaded on use

    dense = model_config()
    text = {k: v for k, v in dense.text_config.to_dict().items()
            if k not in ("intermediate_size", "model_type", "architectures", "transformers_version", "dtype")}
    vision = {k: v for k, v in dense.vision_config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version", "dtype")}
    return Qwen3_5MoeConfig(text_config={**text, **MOE_TEXT}, vision_config=vision,
                            image_token_id=dense.image_token_id, video_token_id=dense.video_token_id,
                            vision_start_token_id=dense.vision_start_token_id,
                            vision_end_token_id=dense.vision_end_token_id, tie_word_embeddings=True, dtype="float32")


def image_png(colour: int, variant: int) -> bytes:
    """A SIDE x SIDE PNG of PALETTE[colour], brightness shifted by a jitter fixed by (colour, variant)."""
    from PIL import Image  # noqa: PLC0415 - Pillow only for image prompts

    gen = torch.Generator().manual_seed(colour * 1000 + variant)
    shift = int(torch.randint(-40, 41, (1,), generator=gen))
    rgb = tuple(max(0, min(255, c + shift)) for c in PALETTE[colour])
    buf = io.BytesIO()
    Image.new("RGB", (SIDE, SIDE), rgb).save(buf, format="PNG")
    return buf.getvalue()


class _Encoder:
    """Rows -> a forward's inputs, as the rollout manager builds them (wire/vision.py)."""

    def __init__(self, tokenizer: Any, image_processor: Any, config: Any):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.tokens = VisionTokens.of(config)

    def prompt(self, png: bytes) -> tuple[list[int], ImageInputs]:
        images = images_from_bytes(self.image_processor, [png])
        return prompt_ids(self.tokenizer, self.tokens, PROMPT, images), images


def _batch(enc: _Encoder, colours: torch.Tensor, variants: torch.Tensor) -> tuple[torch.Tensor, list[ImageInputs]]:
    pairs = [enc.prompt(image_png(int(c), int(v))) for c, v in zip(colours, variants, strict=True)]
    return torch.tensor([p for p, _ in pairs]), [im for _, im in pairs]  # [N, L] (every prompt has one length)


def pretrain(model: Any, enc: _Encoder, target: float, check_every: int, max_steps: int, batch: int, lr: float,
             seed: int) -> int:
    """Next-token loss on the answer digit and <eos> until sampled accuracy reaches `target`; returns the steps."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    digit0, eos = VOCAB.index("0"), VOCAB.index("<eos>")
    step = 0
    while target > 0 and step < max_steps:
        model.train()
        colours = torch.randint(0, len(PALETTE), (batch,), generator=gen)
        prompts, images = _batch(enc, colours, torch.randint(0, VARIANTS, (batch,), generator=gen))
        ids = torch.cat([prompts, (colours + digit0).unsqueeze(1), torch.full((batch, 1), eos)], dim=1)  # [N, L+2]
        inp, mask = ids[:, :-1], torch.ones_like(ids[:, :-1])
        kwargs, _ = forward_inputs(model, inp, mask, images, enc.tokens.image, [prompts.shape[1]] * batch)
        logits = model(attention_mask=mask, **kwargs).logits[:, -2:]  # [N, 2, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, -2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % check_every == 0 and sampled_accuracy(model, enc, n=256, seed=10_000 + step) >= target:
            break
    model.eval()
    return step


@torch.no_grad()
def sampled_accuracy(model: Any, enc: _Encoder, n: int = 512, temperature: float = 1.0, seed: int = 1) -> float:
    """Share of `n` random images whose first sampled (T>0) or greedy (T=0) token is the right digit."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    colours = torch.randint(0, len(PALETTE), (n,), generator=gen)
    prompts, images = _batch(enc, colours, torch.randint(0, VARIANTS, (n,), generator=gen))
    mask = torch.ones_like(prompts)
    kwargs, _ = forward_inputs(model, prompts, mask, images, enc.tokens.image, [prompts.shape[1]] * n)
    logits = model(attention_mask=mask, **kwargs).logits[:, -1]  # [n, V]
    if temperature > 0:
        tok = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(1)
    else:
        tok = logits.argmax(-1)
    return float((tok == colours + VOCAB.index("0")).float().mean())


def write_dataset(out: Path) -> int:
    """train.parquet (PNG bytes in the `image` column) and train.jsonl + images/ (paths relative to the jsonl)."""
    import pyarrow as pa  # noqa: PLC0415 - pyarrow only for parquet data
    import pyarrow.parquet as pq  # noqa: PLC0415 - pyarrow only for parquet data

    rows = [(c, v, image_png(c, v)) for c in range(len(PALETTE)) for v in range(VARIANTS)]
    (out / "images").mkdir(exist_ok=True)
    lines = []
    for c, v, png in rows:
        name = f"images/{c}_{v:02d}.png"
        (out / name).write_bytes(png)
        lines.append(json.dumps({"prompt": PROMPT, "image": name, "label": str(c)}) + "\n")
    (out / "train.jsonl").write_text("".join(lines))
    pq.write_table(pa.table({"prompt": [PROMPT] * len(rows), "image": [png for _, _, png in rows],
                             "label": [str(c) for c, _, _ in rows]}), out / "train.parquet")
    return len(rows)


def make_vl_toy(out_dir: str | Path, target: float | None = None, threads: int = 1, moe: bool = False,
                **pretrain_overrides: Any) -> dict[str, Any]:
    """Write the VL toy model, tokenizer, image processor and dataset to `out_dir`; return what toy.json records.
    `moe`: the Qwen3_5MoeForConditionalGeneration variant (MOE_TEXT)."""
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration  # noqa: PLC0415 - transformers is heavy: loaded on use

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    torch.manual_seed(PRETRAIN["seed"])
    t0 = time.monotonic()
    config = moe_model_config() if moe else model_config()
    model = (Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration)(config)
    tokenizer, image_processor = make_tokenizer(), make_image_processor()
    enc = _Encoder(tokenizer, image_processor, config)
    params: dict[str, Any] = dict(PRETRAIN, **pretrain_overrides)
    params["target"] = params["target"] if target is None else target
    steps = pretrain(model, enc, **params)
    info = {
        "architecture": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "vision_params": sum(p.numel() for p in model.model.visual.parameters()),
        "pretrain": {**params, "steps": steps},
        "pretrain_s": round(time.monotonic() - t0, 1),
        "sampled_accuracy_t1": sampled_accuracy(model, enc, temperature=1.0),
        "greedy_accuracy": sampled_accuracy(model, enc, temperature=0.0),
    }
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    info["rows"] = write_dataset(out)
    (out / "toy.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
