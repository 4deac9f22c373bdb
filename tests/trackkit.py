"""Read back what the trackers wrote, with their own readers: TensorBoard's event_accumulator, and W&B's offline
transaction log (`run-<id>.wandb`) decoded record by record with wandb's own protobuf schema."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from kora_trainer.tracking.names import FIELDS, KL_TAG

# every tag a single-adapter step logs when everything is measured (klToBase, a checkpoint every step, sync
# rollouts); docs/metrics.md tables them
STEP_TAGS = {*FIELDS, KL_TAG, "timing_s/gen", "timing_s/log_probs", "timing_s/update_actor",
             "timing_s/dp_allreduce", "timing_s/update_weights", "timing_s/step", "timing_s/save_checkpoint",
             "perf/time_per_step", "perf/throughput", "sync/bytes", "sync/pushed", "sync/fast_path",
             "sync/adapter_version"}


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar in the event files under `log_dir`."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


_BLOCK = 32768  # the leveldb log format W&B's transaction log uses: 32 KiB blocks of 7-byte-headed chunks
_FULL, _LAST = 1, 4


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B transaction log"
    out, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the rest of a block is padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            out.append(buf)
            buf = b""
    return out


def wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {key: value} of the one offline W&B run under `run_dir` (wandb/offline-run-*/run-*.wandb)."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline W&B run under {run_dir}, found {files}"
    history: dict[int, dict[str, float]] = {}
    for raw in _records(files[0]):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        history.setdefault(int(row["_step"]), {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    return history
