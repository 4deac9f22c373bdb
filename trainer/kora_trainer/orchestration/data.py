"""The prompt dataset: a parquet or jsonl file with an input column and a label column, and for a vision-language
model an image column (`data.imageKey`).

An image cell is the image file's bytes (parquet binary), a path relative to the data file (jsonl or parquet
strings), a {"bytes", "path"} struct (HF datasets' Image feature), or a list of these (several images in one
prompt). Rows carry the file bytes as they are: the rollout manager sends them to the engines base64-encoded and
runs its own image processor on the same bytes, so the trainer and the engine see one image.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Row:
    index: int
    prompt: str
    label: str
    images: tuple[bytes, ...] = ()


def _image_bytes(cell: Any, base: Path, where: str) -> tuple[bytes, ...]:
    """One row's image cell -> the image files' bytes (see the module docstring for the forms)."""
    if cell is None:
        return ()
    if isinstance(cell, list | tuple):
        return tuple(b for c in cell for b in _image_bytes(c, base, where))
    if isinstance(cell, dict):
        if cell.get("bytes"):
            return (bytes(cell["bytes"]),)
        cell = cell.get("path")
    if isinstance(cell, bytes | bytearray | memoryview):
        return (bytes(cell),)
    if isinstance(cell, str):
        path = Path(cell) if Path(cell).is_absolute() else base / cell
        if not path.is_file():
            raise ValueError(f"{where}: image {cell!r} is not a file (paths are relative to the data file's "
                             "directory): fix data.imageKey's column or the path")
        return (path.read_bytes(),)
    raise ValueError(f"{where}: an image is bytes, a path, a {{bytes, path}} struct or a list of these, not "
                     f"{type(cell).__name__} (data.imageKey)")


def _columns(p: Path, keys: list[str]) -> list[list[Any]]:
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq  # noqa: PLC0415 - pyarrow only for parquet data

        table = pq.read_table(p, columns=keys)
        return [table.column(k).to_pylist() for k in keys]
    if p.suffix in (".jsonl", ".json"):
        records = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        missing = [k for k in keys if records and k not in records[0]]
        if missing:
            raise ValueError(f"data.path {p}: rows lack {missing} (data.inputKey / data.labelKey / data.imageKey)")
        return [[r[k] for r in records] for k in keys]
    raise ValueError(f"data.path {p}: use a .parquet or .jsonl file")


def load_rows(path: str, input_key: str, label_key: str, image_key: str | None = None) -> list[Row]:
    p = Path(path)
    cols = _columns(p, [input_key, label_key, *([image_key] if image_key else [])])
    prompts, labels = cols[0], cols[1]
    if not prompts:
        raise ValueError(f"data.path {path} holds no rows")
    images = ([_image_bytes(c, p.parent, f"data.path {path} row {i}") for i, c in enumerate(cols[2])]
              if image_key else [()] * len(prompts))
    return [Row(i, str(q), str(a), im) for i, (q, a, im) in enumerate(zip(prompts, labels, images, strict=True))]


def batches(rows: list[Row], batch_size: int, seed: int) -> Iterator[list[Row]]:
    """Endless shuffled batches; each epoch is a fresh permutation (a short tail is dropped)."""
    rng = random.Random(seed)
    while True:
        order = list(rows)
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield order[start:start + batch_size]
