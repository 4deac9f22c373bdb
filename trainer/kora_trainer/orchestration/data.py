"""The prompt dataset: a parquet or jsonl file with an input column and a label column."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Row:
    index: int
    prompt: str
    label: str


def load_rows(path: str, input_key: str, label_key: str) -> list[Row]:
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(p, columns=[input_key, label_key])
        prompts, labels = table.column(input_key).to_pylist(), table.column(label_key).to_pylist()
    elif p.suffix in (".jsonl", ".json"):
        records = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        missing = [k for k in (input_key, label_key) if records and k not in records[0]]
        if missing:
            raise ValueError(f"data.path {path}: rows lack {missing} (data.inputKey / data.labelKey)")
        prompts, labels = [r[input_key] for r in records], [r[label_key] for r in records]
    else:
        raise ValueError(f"data.path {path}: use a .parquet or .jsonl file")
    if not prompts:
        raise ValueError(f"data.path {path} holds no rows")
    return [Row(i, str(q), str(a)) for i, (q, a) in enumerate(zip(prompts, labels, strict=True))]


def batches(rows: list[Row], batch_size: int, seed: int) -> Iterator[list[Row]]:
    """Endless shuffled batches; each epoch is a fresh permutation (a short tail is dropped)."""
    rng = random.Random(seed)
    while True:
        order = list(rows)
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield order[start:start + batch_size]
