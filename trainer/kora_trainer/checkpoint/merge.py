"""`kora merge`: fold an HF-PEFT adapter into a sharded safetensors checkpoint, shard by shard.

Why not peft's merge_and_unload(): it needs the whole model in memory, AutoModelForCausalLM may
load a multimodal checkpoint as its text-only class (dropping the vision tower on save), and it
cannot see grouped experts stored as 3-D tensors. Here each shard is streamed tensor by tensor
(peak memory ~ the largest folded tensor), names and layout are kept, config/tokenizer/other files
are copied verbatim, and the index is rewritten from what was written.

A diffusion job's export (diffusers' `pytorch_lora_weights.safetensors`, its tensors under `transformer.`) folds
into a diffusers pipeline directory's `transformer/` (`diffusion_pytorch_model*.safetensors`); the pipeline's other
components and files are copied as they are, so `from_pretrained` loads the merged directory like the base.
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
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from kora_trainer.checkpoint.peft_adapter import (
    AdapterError,
    LoRAPair,
    diffusers_component,
    fold,
    load_adapter,
    pair_with_base,
)
from kora_trainer.checkpoint.safetensors_io import (
    Header,
    StreamWriter,
    index_file,
    iter_shards,
    read_array,
    read_header,
)


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


def weights_dir(base: Path, adapter: Path) -> Path:
    """Where in `base` the adapter's weights are: the base itself, or for a diffusers LoRA file its component's
    directory in a pipeline (`base/transformer`; `base` may also be that component directory itself)."""
    component = diffusers_component(adapter)
    if component is None or not (base / component).is_dir():
        return base
    return base / component


@dataclass(frozen=True)
class _Plan:
    """What a merge reads before it writes anything: the weights' shards, their headers, and which tensors fold."""

    src: Path  # the directory of the weights (weights_dir)
    index: Path | None  # the sharded checkpoint's index file
    headers: list[Header]  # each shard's
    pairs: dict[str, LoRAPair]  # base tensor name -> its adapter pair
    config: dict[str, Any]  # the adapter's config
    total: int  # bytes of all the base's tensors


def _plan(base: Path, adapter: Path) -> _Plan:
    """Read the adapter and the base's headers and pair them: every error surfaces before any byte is written."""
    config, tensors = load_adapter(adapter)
    src = weights_dir(base, adapter)
    index = index_file(src)
    headers = [read_header(s) for s in iter_shards(src)]
    shapes = {name: e.shape for h in headers for name, e in h.entries.items()}
    pairs = pair_with_base(config, tensors, shapes)
    total = sum(e.nbytes for h in headers for e in h.entries.values())
    return _Plan(src, index, headers, pairs, config, total)


def merge(base: Path, adapter: Path, out: Path, *, force: bool = False, progress: bool = True) -> MergeReport:
    t0 = time.perf_counter()
    base, adapter, out = Path(base), Path(adapter), Path(out)
    _check_dirs(base, adapter, out, force)
    plan = _plan(base, adapter)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _copy_all_but_weights(base, tmp, plan)
        dst = tmp / plan.src.relative_to(base)
        folded, written, weight_map = _write_shards(dst, plan, progress)
        _write_index(dst, plan, weight_map)
        _write_manifest(tmp, base, adapter, plan, folded)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return MergeReport(out, len(plan.headers), len(weight_map), folded, written, time.perf_counter() - t0)


def _copy_all_but_weights(base: Path, tmp: Path, plan: _Plan) -> None:
    """config.json, tokenizer, generation config, code, a pipeline's other components: all but the weights."""
    skip = {h.path.resolve() for h in plan.headers} | ({plan.index.resolve()} if plan.index is not None else set())
    shutil.copytree(base, tmp, dirs_exist_ok=True,
                    ignore=lambda d, names: [n for n in names if (Path(d) / n).resolve() in skip])


def _write_shards(dst: Path, plan: _Plan, progress: bool) -> tuple[int, int, dict[str, str]]:
    """Each shard streamed tensor by tensor into `dst`, the paired ones folded: (folded, bytes, weight map)."""
    folded = written = 0
    weight_map: dict[str, str] = {}
    with _progress(progress, plan.total) as advance:
        for h in plan.headers:
            ordered = sorted(h.entries.values(), key=lambda e: e.start)
            layout = [(e.name, e.dtype, e.shape, e.nbytes) for e in ordered]
            writer = StreamWriter(dst / h.path.name, layout, h.metadata)
            with h.path.open("rb") as f:
                for e in ordered:
                    if e.name in plan.pairs:
                        writer.write_array(e.name, fold(read_array(f, e), e.dtype, plan.pairs[e.name]))
                        folded += 1
                    else:
                        writer.copy_bytes(e.name, f, e)
                    weight_map[e.name] = h.path.name
                    written += e.nbytes
                    advance(e.nbytes)
            writer.close()
    return folded, written, weight_map


def _write_index(dst: Path, plan: _Plan, weight_map: dict[str, str]) -> None:
    """The base's index, rewritten from what was written."""
    if plan.index is None:
        return
    doc = json.loads(plan.index.read_text())
    doc["metadata"] = {**doc.get("metadata", {}), "total_size": plan.total}
    doc["weight_map"] = weight_map
    (dst / plan.index.name).write_text(json.dumps(doc, indent=2) + "\n")


def _write_manifest(tmp: Path, base: Path, adapter: Path, plan: _Plan, folded: int) -> None:
    (tmp / "kora_merge.json").write_text(
        json.dumps(
            {
                "base": str(base.resolve()),
                "adapter": str(adapter.resolve()),
                "folded_into": str(plan.src.relative_to(base)),
                "folded_tensors": folded,
                "lora_alpha": plan.config.get("lora_alpha"),
                "r": plan.config.get("r"),
            },
            indent=2,
        )
        + "\n"
    )


class _progress:
    """A rich progress bar over bytes (silent when disabled or not a terminal)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda n: None

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
