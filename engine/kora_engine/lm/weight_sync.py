"""The engine's end of the weight-update group: join it, and receive what the trainer broadcasts.

Mirrors SGLang's `WeightUpdater` (sglang 0.5.23,
`sglang/srt/model_executor/model_runner_components/weight_updater.py`): the engine's rank is
`rank_offset + tp_rank` (tp_rank is 0 here: the reference engine is one process), groups are kept
by `group_name`, and the per-tensor form (`load_format: null`) receives one broadcast per tensor,
in metadata order, from src 0.

`load_format: "flattened_bucket"` is kora's bucket: ONE broadcast of a flat uint8 tensor holding
every piece's bytes (`sync.protocol.pack`), so one bucket may mix dtypes and a tensor larger than
the bucket cap arrives as byte ranges over several calls (kora's optional `byte_ranges` field;
`protocol.Assembler` keeps the partial tensors between calls). A stock SGLang instead broadcasts
a flat tensor it builds with its `FlattenedTensorBucket` from names/dtypes/shapes alone (no
byte ranges) — a kora trainer talking to a stock SGLang therefore uses the per-tensor form or
buckets that split no tensor ⚠ (the byte layout of SGLang's flat tensor is not checked here).

All calls that touch a group run on ONE thread (the server's sync executor), because the
collectives of a group must be issued in the same order on every member.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kora_trainer.wire.group import WeightUpdateGroup, init_weight_update_group
from kora_trainer.wire.protocol import FLAT, Assembler, dtype_of

Named = list[tuple[str, torch.Tensor]]


@dataclass
class BucketMeta:
    """The metadata-only half of a bucket, as the HTTP body carries it."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    byte_ranges: list[list[int]] | None = None
    load_format: str | None = None

    def as_protocol(self) -> dict[str, list[Any]]:
        meta: dict[str, list[Any]] = {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes}
        if self.byte_ranges is not None:
            meta["byte_ranges"] = self.byte_ranges
        return meta

    def flat_nbytes(self) -> int:
        if self.byte_ranges is not None:
            return sum(int(end) - int(start) for start, end in self.byte_ranges)
        total = 0
        for dtype, shape in zip(self.dtypes, self.shapes, strict=True):
            n = dtype_of(dtype).itemsize
            for d in shape:
                n *= int(d)
            total += n
        return total

    def validate(self) -> None:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        if self.byte_ranges is not None and len(self.byte_ranges) != len(self.names):
            raise ValueError("byte_ranges must have one [start, end] per name")
        for d in self.dtypes:
            dtype_of(d)
        if self.load_format != FLAT and self.byte_ranges is not None:
            for (start, end), dtype, shape in zip(self.byte_ranges, self.dtypes, self.shapes, strict=True):
                n = dtype_of(dtype).itemsize
                for dim in shape:
                    n *= int(dim)
                if (int(start), int(end)) != (0, n):
                    raise ValueError("a tensor split into byte ranges needs load_format flattened_bucket")


@dataclass
class WeightReceiver:
    """Groups by name, plus one Assembler per stream (full weights of a group; each staged adapter)."""

    tp_rank: int = 0
    groups: dict[str, WeightUpdateGroup] = field(default_factory=dict)
    assemblers: dict[str, Assembler] = field(default_factory=dict)
    receiving: int = 0  # receive() calls under way, i.e. waiting in their broadcasts (GET /kora/state)

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, device: torch.device) -> tuple[bool, str]:
        if group_name in self.groups:
            return False, f"Failed to initialize custom process group: group {group_name} already exists."
        if backend == "nccl" and device.type != "cuda":
            return False, ("Failed to initialize custom process group: backend nccl needs a CUDA engine; "
                           "this engine runs on CPU, use backend gloo.")
        try:
            self.groups[group_name] = init_weight_update_group(
                master_address, master_port, rank_offset + self.tp_rank, world_size, group_name, backend)
        except Exception as e:
            return False, f"Failed to initialize custom process group: {e}."
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        group = self.groups.pop(group_name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        for key in [k for k in self.assemblers if k.startswith(f"{group_name}/")]:
            del self.assemblers[key]
        return True, "Succeeded to destroy custom process group."

    def group(self, group_name: str) -> WeightUpdateGroup:
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"Group {group_name} not in {list(self.groups)}. "
                             "Please call `init_weights_update_group` first.")
        return group

    def receive(self, meta: BucketMeta, group_name: str, stream: str = "weights") -> Named:
        """Receive one call's broadcasts; returns the tensors it completed, in metadata order."""
        meta.validate()
        group = self.group(group_name)
        self.receiving += 1
        try:
            return self._receive(meta, group, f"{group_name}/{stream}")
        finally:
            self.receiving -= 1

    def _receive(self, meta: BucketMeta, group: WeightUpdateGroup, stream_key: str) -> Named:
        if meta.load_format == FLAT:
            flat = torch.empty(meta.flat_nbytes(), dtype=torch.uint8, device=group.device)
            group.broadcast(flat, src=0)
            assembler = self.assemblers.setdefault(stream_key, Assembler(group.device))
            return list(assembler.feed(meta.as_protocol(), flat))
        if meta.load_format is not None:
            raise ValueError(f"Unknown load_format={meta.load_format}")
        out: Named = []
        for name, dtype, shape in zip(meta.names, meta.dtypes, meta.shapes, strict=True):
            t = torch.empty([int(d) for d in shape], dtype=dtype_of(dtype), device=group.device)
            group.broadcast(t, src=0)
            out.append((name, t))
        return out

    def reset_stream(self, group_name: str, stream: str) -> None:
        self.assemblers.pop(f"{group_name}/{stream}", None)
