"""The toy task: a tiny Qwen3 that adds two-digit numbers, just good enough to have room to learn.

`kora make-toy DIR` writes, all loadable by the real loading code (`from_pretrained` on DIR):
  DIR/config.json, model.safetensors   Qwen3ForCausalLM, 2 layers, hidden 128, 4 heads (2 KV), MLP 512
  DIR/tokenizer.json, ...              PreTrainedTokenizerFast over a WordLevel vocab (one token per character)
  DIR/train.parquet                    columns prompt ("07+45=") and label ("052"): all 10,000 sums
  DIR/small.parquet                    the 400 sums of two numbers below 20 (a second task, for multi-LoRA)
  DIR/toy.json                         how it was made and the accuracy it starts with

The model is pretrained briefly with next-token loss on the answers, stopped early so it starts with
partial skill (~0.2 exact accuracy sampled at T=1, DESIGN.md): GRPO then has signal (some samples in
most groups are right) and room (most are wrong). Measured alternative: a plain LM loss on every token
(`loss_on="all"`) reaches 0.18 sampled / 0.36 greedy after 250 steps, but GRPO then levels off lower
(~0.65 after 5 minutes, against ~0.75 from the answer-only toy). Measured too: label smoothing 0.3-0.5 in
pretraining with a greedy-accuracy stop at 0.9 (a base that knows most answers but is unsure at T=1: 0.12-0.28
sampled) — GRPO then sharpens it much more slowly (+0.24 to +0.28 where this toy gains +0.42 in the same 150 s of
training, bench/toy_seeds.py on the device's CPUs), so the default stays the plain answer-only loss.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

import torch

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
# ids are list positions (pad 0, bos 1, eos 2, '0' 3 … '9' 12, '+' 13, '=' 14), as in tests/tinymodel.py;
# the embedding has VOCAB_SIZE = 16 rows, the last one unused
VOCAB = [PAD, BOS, EOS, *"0123456789", "+", "="]
VOCAB_SIZE = 16
PROMPT_LEN = 7  # <bos> a a + b b =
SMALL_DATASET = "small.parquet"  # make_toy's second dataset: the sums of two numbers below 20
ANSWER_LEN = 3  # d d d (then <eos>)

# Pretraining stops at the first check where sampled (T=1) accuracy reaches `target`: the curve is a
# steep phase transition whose step count moves with the init and thread count, so a fixed step
# count lands anywhere between 0.05 and 0.95. ~0.2 sampled is DESIGN.md's start point; with these
# settings (1 thread) it stops after 95 steps, ~19 s: 0.18 sampled, 0.50 greedy on a fresh sample.
PRETRAIN = {"target": 0.2, "check_every": 5, "max_steps": 1500, "batch": 256, "lr": 3e-3, "seed": 0}


def make_tokenizer() -> Any:
    """One token per character; `tokenizer("07+45=")` -> [<bos>, 0, 7, +, 4, 5, =]."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: PLC0415 - tokenizers loads on use (toy making)
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - transformers is heavy: loaded on use

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"<[a-z]+>|."), behavior="isolated")
    tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tk.decoder = decoders.Fuse()  # WordLevel's default decode joins with spaces; digits must not be
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=PAD, padding_side="left", clean_up_tokenization_spaces=False)


def model_config() -> Any:
    from transformers import Qwen3Config  # noqa: PLC0415 - transformers is heavy: loaded on use

    return Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=VOCAB.index(PAD), bos_token_id=VOCAB.index(BOS),
        eos_token_id=VOCAB.index(EOS), dtype="float32",
    )


def encode_batch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N] operands -> [N, 11] ids of `<bos> a a + b b = d d d <eos>` (a fixed layout: no padding)."""
    digit = VOCAB.index("0")
    s = a + b

    def digits(x: torch.Tensor, n: int) -> list[torch.Tensor]:
        return [(x // 10 ** (n - 1 - i)) % 10 + digit for i in range(n)]

    cols = [torch.full_like(a, VOCAB.index(BOS)), *digits(a, 2), torch.full_like(a, VOCAB.index("+")),
            *digits(b, 2), torch.full_like(a, VOCAB.index("=")), *digits(s, 3), torch.full_like(a, VOCAB.index(EOS))]
    return torch.stack(cols, dim=1)


def pretrain(model: Any, target: float, check_every: int, max_steps: int, batch: int, lr: float,
             seed: int, loss_on: Literal["answer", "all"] = "answer",
             label_smoothing: float = 0.0, metric: Literal["sampled", "greedy"] = "sampled") -> int:
    """Next-token loss (on the answers, or on every token) until the accuracy `metric` (sampled at T=1, or
    greedy) reaches `target`; returns the steps taken."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    step = 0
    while target > 0 and step < max_steps:
        model.train()
        a, b = torch.randint(0, 100, (batch,), generator=gen), torch.randint(0, 100, (batch,), generator=gen)
        ids = encode_batch(a, b)
        logits = model(input_ids=ids[:, :-1]).logits  # [N, 10, V]
        start = PROMPT_LEN if loss_on == "answer" else 1  # "all": plain LM loss, operands included
        target_ids = ids[:, start:]  # [N, 11-start]
        pred = logits[:, start - 1:]  # [N, 11-start, V]
        loss = torch.nn.functional.cross_entropy(pred.reshape(-1, VOCAB_SIZE), target_ids.reshape(-1),
                                                 label_smoothing=label_smoothing)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % check_every == 0:
            model.eval()
            temperature = 1.0 if metric == "sampled" else 0.0
            if sampled_accuracy(model, n=512, temperature=temperature, seed=10_000 + step) >= target:
                break
    model.eval()
    return step


@torch.no_grad()
def sampled_accuracy(model: Any, n: int = 1000, temperature: float = 1.0, seed: int = 1) -> float:
    """Exact-answer accuracy of `n` random sums, sampling (T>0) or greedy (T=0), no KV cache."""
    gen = torch.Generator().manual_seed(seed)
    ids = encode_batch(torch.randint(0, 100, (n,), generator=gen), torch.randint(0, 100, (n,), generator=gen))
    seq = ids[:, :PROMPT_LEN]
    for _ in range(ANSWER_LEN):
        logits = model(input_ids=seq).logits[:, -1]  # [n, V]
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return float((seq[:, PROMPT_LEN:] == ids[:, PROMPT_LEN:PROMPT_LEN + ANSWER_LEN]).all(1).float().mean())


def write_dataset(path: Path, below: int = 100) -> int:
    """All sums of two numbers below `below` (10,000 by default) as parquet, or as JSON lines when `path` ends in
    .jsonl (no pyarrow needed)."""
    rows = [(f"{a:02d}+{b:02d}=", f"{a + b:03d}") for a in range(below) for b in range(below)]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"prompt": p, "label": label}) + "\n" for p, label in rows))
        return len(rows)
    import pyarrow as pa  # noqa: PLC0415 - pyarrow only for parquet data
    import pyarrow.parquet as pq  # noqa: PLC0415 - pyarrow only for parquet data

    table = pa.table({"prompt": [r[0] for r in rows], "label": [r[1] for r in rows]})
    pq.write_table(table, path)
    return len(rows)


def make_toy(out_dir: str | Path, target: float | None = None, threads: int = 1,
             dataset: str = "train.parquet", **pretrain_overrides: Any) -> dict[str, Any]:
    """Write the toy model, tokenizer and dataset (`dataset`: train.parquet, or train.jsonl) to `out_dir`;
    return what toy.json records."""
    from transformers import Qwen3ForCausalLM  # noqa: PLC0415 - transformers is heavy: loaded on use

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    torch.manual_seed(PRETRAIN["seed"])
    t0 = time.monotonic()
    model = Qwen3ForCausalLM(model_config())
    params: dict[str, Any] = dict(PRETRAIN, **pretrain_overrides)
    params["target"] = params["target"] if target is None else target
    steps = pretrain(model, **params)
    info = {
        "params": sum(p.numel() for p in model.parameters()),
        "pretrain": {**params, "steps": steps},
        "pretrain_s": round(time.monotonic() - t0, 1),
        "sampled_accuracy_t1": sampled_accuracy(model, temperature=1.0),
        "greedy_accuracy": sampled_accuracy(model, temperature=0.0),
    }
    model.save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    info["rows"] = write_dataset(out / dataset)
    # a second task for multi-LoRA runs (trainer/examples/multi_lora.yaml): the 400 sums of numbers below 20
    info["small_rows"] = write_dataset(out / SMALL_DATASET.replace(".parquet", Path(dataset).suffix), below=20)
    (out / "toy.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
