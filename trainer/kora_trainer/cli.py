"""The trainer wing's `kora` subcommands (plugged in through the `kora.commands` entry points).

Heavy imports (torch, transformers) happen inside the command functions, so `kora --help` stays
fast and works in an image without the trainer extra.
"""

from __future__ import annotations

import argparse
import json


def register_make_toy(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("make-toy", help="write the toy model, tokenizer and addition dataset to DIR",
                       description="Write a tiny Qwen3 (briefly pretrained on 2-digit addition), its tokenizer "
                                   "and train.parquet to DIR, loadable with from_pretrained.")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--target", type=float, default=None,
                   help="stop pretraining once sampled (T=1) accuracy reaches this (default 0.2; 0 = no pretraining)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: see orchestration/cluster.py)")
    p.set_defaults(func=_make_toy)


def _make_toy(args: argparse.Namespace) -> int:
    from kora_trainer.toy import make_toy

    info = make_toy(args.dir, target=args.target, threads=args.threads)
    print(json.dumps({"dir": args.dir, **info}))
    return 0
