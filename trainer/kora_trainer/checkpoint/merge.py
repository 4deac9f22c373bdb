"""`kora merge`: fold an HF-PEFT adapter into a sharded safetensors checkpoint, shard by shard.

Why not peft's merge_and_unload(): it needs the whole model in memory, AutoModelForCausalLM may
load a multimodal checkpoint as its text-only class (dropping the vision tower on save), and it
cannot see grouped experts stored as 3-D tensors. Here each shard is streamed tensor by tensor
(peak memory ~ the largest folded tensor), names and layout are kept, config/tokenizer/other files
are copied verbatim, and the index is rewritten from what was written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kora_trainer.checkpoint.peft_adapter import AdapterError, fold, load_adapter, pair_with_base
from kora_trainer.checkpoint.safetensors_io import StreamWriter, iter_shards, read_array, read_header

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class MergeReport:
    out_dir: Path
    shards: int
    tensors: int
    folded: int
    bytes: int
    seconds: float


def _check_dirs(base: Path, adapter: Path, out: Path, force: bool) -> None:
    if not base.is_dir():
        raise AdapterError(f"--base {base}: not a directory")
    if out.resolve() in (base.resolve(), adapter.resolve()):
        raise AdapterError(f"--out {out}: must differ from --base and --adapter (never overwrite inputs)")
    if out.exists() and any(out.iterdir()) and not force:
        raise AdapterError(f"--out {out}: exists and is not empty; choose a new directory or pass --force")


def merge(base: Path, adapter: Path, out: Path, *, force: bool = False, progress: bool = True) -> MergeReport:
    t0 = time.perf_counter()
    base, adapter, out = Path(base), Path(adapter), Path(out)
    _check_dirs(base, adapter, out, force)
    config, tensors = load_adapter(adapter)
    headers = [read_header(s) for s in iter_shards(base)]
    shapes = {name: e.shape for h in headers for name, e in h.entries.items()}
    pairs = pair_with_base(config, tensors, shapes)  # every error surfaces before any byte is written
    total = sum(e.nbytes for h in headers for e in h.entries.values())

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    folded = written = 0
    weight_map: dict[str, str] = {}
    try:
        with _progress(progress, total) as advance:
            for h in headers:
                ordered = sorted(h.entries.values(), key=lambda e: e.start)
                layout = [(e.name, e.dtype, e.shape, e.nbytes) for e in ordered]
                writer = StreamWriter(tmp / h.path.name, layout, h.metadata)
                with h.path.open("rb") as src:
                    for e in ordered:
                        if e.name in pairs:
                            writer.write_array(e.name, fold(read_array(src, e), e.dtype, pairs[e.name]))
                            folded += 1
                        else:
                            writer.copy_bytes(e.name, src, e)
                        weight_map[e.name] = h.path.name
                        written += e.nbytes
                        advance(e.nbytes)
                writer.close()
        for item in base.iterdir():  # config.json, tokenizer, generation config, code, ...
            if item.name.endswith(".safetensors") or item.name == INDEX:
                continue
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
        if (base / INDEX).exists():
            index = json.loads((base / INDEX).read_text())
            index["metadata"] = {**index.get("metadata", {}), "total_size": total}
            index["weight_map"] = weight_map
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "kora_merge.json").write_text(
            json.dumps(
                {
                    "base": str(base.resolve()),
                    "adapter": str(adapter.resolve()),
                    "folded_tensors": folded,
                    "lora_alpha": config.get("lora_alpha"),
                    "r": config.get("r"),
                },
                indent=2,
            )
            + "\n"
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return MergeReport(out, len(headers), len(weight_map), folded, written, time.perf_counter() - t0)


class _progress:
    """A rich progress bar over bytes (silent when disabled or not a terminal)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda n: None
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self._bar = Progress(
            "merging", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(), transient=True
        )
        self._bar.__enter__()
        task = self._bar.add_task("merge", total=self.total)
        return lambda n: self._bar.advance(task, n)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.enabled:
            self._bar.__exit__(exc_type, exc, tb)
