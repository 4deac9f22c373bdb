"""`kora merge` (plugged into the `kora` CLI through the kora.commands entry points)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _merge(args: argparse.Namespace) -> int:
    from kora_trainer.checkpoint.merge import merge  # noqa: PLC0415 - a `kora` subcommand: numpy/safetensors load only when a merge runs
    from kora_trainer.checkpoint.peft_adapter import AdapterError  # noqa: PLC0415 - a `kora` subcommand: numpy/safetensors load only when a merge runs

    try:
        report = merge(
            Path(args.base),
            Path(args.adapter),
            Path(args.out),
            force=args.force,
            progress=not args.quiet and sys.stderr.isatty(),
        )
    except (AdapterError, FileNotFoundError) as e:
        print(f"kora merge: {e}", file=sys.stderr)
        return 1
    print(
        f"merged {report.folded} adapter pairs into {report.tensors} tensors across {report.shards} shard(s): "
        f"{report.bytes / 2**30:.2f} GiB in {report.seconds:.1f} s -> {report.out_dir}"
    )
    return 0


def register_merge(sub: Any) -> None:
    p = sub.add_parser("merge", help="fold an HF-PEFT adapter into a base checkpoint, one shard at a time")
    p.add_argument("--base", required=True,
                   help="HF checkpoint directory (safetensors, sharded or not), or a diffusers pipeline directory")
    p.add_argument("--adapter", required=True, help="HF-PEFT adapter directory (adapter_config.json + safetensors), "
                   "or a diffusion job's export (diffusers' pytorch_lora_weights.safetensors)")
    p.add_argument("--out", required=True, help="new directory for the merged checkpoint")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_merge)
