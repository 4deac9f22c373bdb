"""What crosses the weight-update group: flat byte buckets, and the metadata that describes them.

HTTP carries only metadata (names, dtypes, shapes, which byte range of each tensor a bucket holds);
the bytes go as ONE broadcast per bucket (`load_format: "flattened_bucket"`), whatever the mix of
dtypes. A bucket never exceeds the cap (`sync.bufferSize`): a tensor larger than the cap is sent as
byte-range pieces over several buckets and reassembled by the receiver; a *group* (a lora_A/lora_B
pair for EngineMerge) is never split and must fit in one bucket.

Also supports SGLang's per-tensor form (`load_format: None`: one broadcast per tensor), which is
what a stock SGLang engine expects; there a tensor is never split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

FLAT = "flattened_bucket"


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling: the torch attribute name, e.g. 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of tensor `name` (the whole tensor when start == 0 and end == nbytes)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def tensor_nbytes(self) -> int:
        n = dtype_of(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class Bucket:
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def metadata(self) -> dict[str, list[Any]]:
        """The JSON the HTTP call carries (SGLang's names/dtypes/shapes + kora's byte ranges)."""
        return {
            "names": [p.name for p in self.pieces],
            "dtypes": [p.dtype for p in self.pieces],
            "shapes": [list(p.shape) for p in self.pieces],
            "byte_ranges": [[p.start, p.end] for p in self.pieces],
        }


Named = tuple[str, torch.Tensor]


def plan_buckets(groups: Iterable[Sequence[Named]], cap: int) -> list[Bucket]:
    """Pack groups of tensors into buckets of at most `cap` bytes, in order.

    A group of one tensor may be split into byte ranges; a group of several (an A/B pair) is
    kept whole and must fit in `cap`.
    """
    if cap <= 0:
        raise ValueError("sync.bufferSize must be positive")
    buckets: list[Bucket] = [Bucket()]
    for group in groups:
        pieces = [Piece(n, dtype_name(t.dtype), tuple(t.shape), 0, t.numel() * t.element_size()) for n, t in group]
        size = sum(p.nbytes for p in pieces)
        if len(pieces) > 1:
            if size > cap:
                names = ", ".join(p.name for p in pieces)
                raise ValueError(f"tensors that must travel together ({names}) take {size} bytes, more than "
                                 f"sync.bufferSize {cap}: raise sync.bufferSize")
            if buckets[-1].nbytes + size > cap:
                buckets.append(Bucket())
            buckets[-1].pieces.extend(pieces)
            continue
        (piece,) = pieces
        start = 0
        while start < piece.end or piece.end == 0:
            room = cap - buckets[-1].nbytes
            if room <= 0:
                buckets.append(Bucket())
                room = cap
            end = min(piece.end, start + room)
            buckets[-1].pieces.append(Piece(piece.name, piece.dtype, piece.shape, start, end))
            start = end
            if piece.end == 0:
                break
    return [b for b in buckets if b.pieces]


def pack(bucket: Bucket, tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """One flat uint8 tensor holding every piece's bytes, in bucket order."""
    flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    offset = 0
    for p in bucket.pieces:
        src = tensors[p.name].detach().contiguous().reshape(-1).view(torch.uint8)[p.start:p.end]
        flat[offset:offset + p.nbytes].copy_(src)
        offset += p.nbytes
    return flat


class Assembler:
    """Receiver side: feed each bucket's metadata and flat bytes; get back completed tensors."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = device
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}

    def feed(self, metadata: dict[str, list[Any]], flat: torch.Tensor) -> Iterator[Named]:
        ranges = metadata.get("byte_ranges")
        offset = 0
        for i, name in enumerate(metadata["names"]):
            dtype, shape = dtype_of(metadata["dtypes"][i]), tuple(metadata["shapes"][i])
            numel = 1
            for d in shape:
                numel *= d
            total = numel * dtype.itemsize
            start, end = ranges[i] if ranges else (0, total)
            chunk = flat[offset:offset + (end - start)]
            offset += end - start
            if start == 0 and end == total:
                yield name, chunk.view(dtype).reshape(shape)
                continue
            buf, got = self._partial.get(name, (torch.empty(total, dtype=torch.uint8, device=self.device), 0))
            buf[start:end].copy_(chunk)
            got += end - start
            if got == total:
                self._partial.pop(name, None)
                yield name, buf.view(dtype).reshape(shape)
            else:
                self._partial[name] = (buf, got)
        if offset != flat.numel():
            raise ValueError(f"bucket holds {flat.numel()} bytes but its metadata describes {offset}")

    @property
    def incomplete(self) -> list[str]:
        return sorted(self._partial)


_CHUNK = 1 << 24  # 16-bit words per reduction: bounds the int64 temporaries (128 MiB) and keeps sums exact
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _position_weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = torch.arange(_CHUNK, device=device, dtype=torch.int64) % 65521 + 1
    return w


def fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """Two exact integer sums over the tensor's bytes (as 16-bit words), computed on the tensor's own device:
    the plain sum and a position-weighted one (moved or swapped bytes change it). Integer sums are exact and
    order-free, so CPU and GPU agree bit for bit — and a GPU never ships the bytes to the host to hash them
    (sha256 over an 8 GB model on the host took 14.8 s of a colocated H200 push; this is one pass on device).
    Not cryptographic: it catches torn, misrouted and stale pushes, which is its job."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 2:
        b = torch.cat([b, b.new_zeros(1)])
    words = b.view(torch.int16)
    weights = _position_weights(words.device)
    plain = weighted = 0
    for i, start in enumerate(range(0, words.numel(), _CHUNK)):
        c = words[start:start + _CHUNK].to(torch.int64)  # |c| < 2^15, weights < 2^16: no int64 overflow
        plain += int(c.sum())
        weighted += int((c * weights[:c.numel()]).sum()) * (i + 1)
    return plain, weighted


def tensor_digest(name: str, t: torch.Tensor) -> bytes:
    """What the checksum hashes for one tensor: its name, dtype, shape and byte fingerprint."""
    plain, weighted = fingerprint(t)
    return f"{name}|{dtype_name(t.dtype)}|{tuple(t.shape)}|{plain}|{weighted};".encode()


def checksum(named: Iterable[Named]) -> str:
    """sha256 over each tensor's digest, in the given order: the same on the trainer and the engine, on
    CPU or GPU (tensor_digest reads the bytes on their own device)."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(tensor_digest(name, t))
    return h.hexdigest()[:16]


class PackedChecksum:
    """`checksum` of tensors laid back to back in one flat uint8 buffer (`layout`: (name, dtype, shape) in order,
    no padding), in ONE pass on the buffer's device and ONE host read: every word's weight and tensor are fixed by
    the layout, so both sums of every tensor's `fingerprint` come out of two integer `index_add_`s. The same value
    as `checksum` over views of the tensors (per-tensor fingerprints cost a few launches and two host reads each:
    ~10 ms for an adapter of ~300 tensors on a GPU, where this is one pass over its bytes). Falls back to the
    per-tensor form for a layout it cannot take exactly (a tensor of an odd byte count, or one so large that its
    weighted sum could leave int64)."""

    def __init__(self, layout: Sequence[tuple[str, torch.dtype, Sequence[int]]], device: torch.device | str = "cpu"):
        self.layout = [(name, dtype, tuple(int(d) for d in shape)) for name, dtype, shape in layout]
        sizes = []
        for _, dtype, shape in self.layout:
            n = dtype.itemsize
            for d in shape:
                n *= d
            sizes.append(n)
        self.sizes, self.nbytes = sizes, sum(sizes)
        words = torch.tensor([n // 2 for n in sizes], dtype=torch.int64)
        self.exact = all(n % 2 == 0 and n // 2 <= 8 * _CHUNK for n in sizes)
        self.seg = self.weight = None
        if self.exact:
            seg = torch.repeat_interleave(torch.arange(len(sizes)), words)
            pos = torch.arange(int(words.sum())) - torch.repeat_interleave(words.cumsum(0) - words, words)
            self.seg = seg.to(device=device, dtype=torch.int32)  # 4 bytes a word of the layout, kept
            self.weight = ((pos % _CHUNK % 65521 + 1) * (pos // _CHUNK + 1)).to(device=device, dtype=torch.int32)

    def views(self, flat: torch.Tensor) -> list[Named]:
        out, off = [], 0
        for (name, dtype, shape), n in zip(self.layout, self.sizes, strict=True):
            piece = flat[off:off + n]
            out.append((name, (piece if off % dtype.itemsize == 0 else piece.clone()).view(dtype).view(shape)))
            off += n
        return out

    def __call__(self, flat: torch.Tensor) -> str:
        """The checksum of `flat` (uint8, at least the layout's bytes; its first bytes are read)."""
        if not self.exact:
            return checksum(self.views(flat))
        assert self.seg is not None and self.weight is not None
        words = flat[:self.nbytes].view(torch.int16).to(torch.int64)
        sums = torch.zeros((2, len(self.layout)), dtype=torch.int64, device=flat.device)
        sums[0].index_add_(0, self.seg, words)
        sums[1].index_add_(0, self.seg, words * self.weight)
        h = hashlib.sha256()
        for (name, dtype, shape), plain, weighted in zip(self.layout, *sums.tolist(), strict=True):
            h.update(f"{name}|{dtype_name(dtype)}|{shape}|{plain}|{weighted};".encode())
        return h.hexdigest()[:16]
