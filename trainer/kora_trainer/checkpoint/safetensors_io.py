"""Stream safetensors files tensor by tensor, so memory is bounded by one tensor, not one shard.

The `safetensors` library reads through mmap (touched pages count toward RSS) and writes with
`save_file`, which needs the whole shard in memory. The format is simple and fixed — an 8-byte
little-endian header length, a JSON header of {name: {dtype, shape, data_offsets}}, then the raw
bytes — so `kora merge` reads and writes it directly and copies untouched tensors in chunks.

numpy, not torch: importing torch alone costs ~700 MB of RSS, more than the tool's whole memory
budget. bf16 (which numpy lacks) is carried as its raw uint16 bits; `fold.py` converts.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

# safetensors dtype -> the numpy dtype its bytes are read as (bf16 as raw uint16 bits)
NUMPY: dict[str, type] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
CHUNK = 16 * 2**20


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    path: Path
    entries: dict[str, Entry]
    metadata: dict[str, str] | None


def read_header(path: Path) -> Header:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw: dict[str, Any] = json.loads(f.read(n))
    meta = raw.pop("__metadata__", None)
    base = 8 + n
    entries = {
        name: Entry(
            name, info["dtype"], tuple(info["shape"]), base + info["data_offsets"][0], base + info["data_offsets"][1]
        )
        for name, info in raw.items()
    }
    return Header(path, entries, meta)


def read_array(f: io.BufferedIOBase, entry: Entry) -> np.ndarray:
    """One tensor, read into memory it owns (no mmap). BF16 comes back as uint16 bits."""
    if entry.dtype not in NUMPY:
        raise ValueError(f"{entry.name}: dtype {entry.dtype} is not supported by kora merge")
    out: np.ndarray = np.empty(entry.shape, dtype=NUMPY[entry.dtype])
    f.seek(entry.start)
    # numpy's stubs give ndarray __buffer__ (typing's Buffer) on Python >= 3.12 only
    if f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != entry.nbytes:  # type: ignore[arg-type]
        raise ValueError(f"{entry.name}: file ended early")
    return out


class StreamWriter:
    """Writes a safetensors file whose tensor list (names, dtypes, shapes) is known up front."""

    def __init__(
        self, path: Path, layout: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None
    ):
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = metadata
        offset = 0
        self._order = []
        for name, dtype, shape, nbytes in layout:
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, nbytes))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        self._f = path.open("wb")
        self._f.write(struct.pack("<Q", len(blob)))
        self._f.write(blob)
        self._next = 0

    def _expect(self, name: str, nbytes: int) -> None:
        want_name, want_bytes = self._order[self._next]
        if (name, nbytes) != (want_name, want_bytes):
            raise ValueError(f"writer expected {want_name} ({want_bytes} bytes), got {name} ({nbytes} bytes)")
        self._next += 1

    def write_array(self, name: str, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self._expect(name, data.nbytes)
        self._f.write(memoryview(data))  # type: ignore[arg-type]  # numpy's Buffer on 3.12+ only, as above

    def copy_bytes(self, name: str, src: IO[bytes], entry: Entry) -> None:
        """Copy an untouched tensor in bounded chunks."""
        self._expect(name, entry.nbytes)
        src.seek(entry.start)
        left = entry.nbytes
        while left:
            chunk = src.read(min(CHUNK, left))
            if not chunk:
                raise ValueError(f"{entry.name}: file ended early")
            self._f.write(chunk)
            left -= len(chunk)

    def close(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"writer closed after {self._next} of {len(self._order)} tensors")
        self._f.flush()
        self._f.close()


# a checkpoint directory's weights: transformers' file names, then diffusers' (a pipeline component's directory)
WEIGHT_STEMS = ("model", "diffusion_pytorch_model")


def index_file(model_dir: Path) -> Path | None:
    """The shard index of a checkpoint directory (`model.safetensors.index.json` or diffusers' name), if any."""
    return next((model_dir / f"{stem}.safetensors.index.json" for stem in WEIGHT_STEMS
                 if (model_dir / f"{stem}.safetensors.index.json").exists()), None)


def iter_shards(model_dir: Path) -> Iterator[Path]:
    """The safetensors shards of an HF (or diffusers component) checkpoint directory, in index order."""
    index = index_file(model_dir)
    if index is not None:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        seen: list[str] = []
        for shard in weight_map.values():
            if shard not in seen:
                seen.append(shard)
        yield from (model_dir / s for s in seen)
        return
    for stem in WEIGHT_STEMS:
        if (model_dir / f"{stem}.safetensors").exists():
            yield model_dir / f"{stem}.safetensors"
            return
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json (nor diffusers' "
                            "diffusion_pytorch_model.safetensors)")
