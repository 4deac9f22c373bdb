"""The trainer wing's `kora` subcommands (plugged in through the `kora.commands` entry points).

Heavy imports (torch, transformers) happen inside the command functions, so `kora --help` stays
fast and works in an image without the trainer extra.
"""

from __future__ import annotations

import argparse
import json


def register_make_toy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("make-toy", help="write the toy model, tokenizer and addition dataset to DIR",
                       description="Write a tiny Qwen3 (briefly pretrained on 2-digit addition), its tokenizer "
                                   "and train.parquet to DIR, loadable with from_pretrained.")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--target", type=float, default=None,
                   help="stop pretraining once sampled (T=1) accuracy reaches this (default 0.2; 0 = no pretraining)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: see orchestration/cluster.py)")
    p.add_argument("--diffusion", action="store_true",
                   help="write the diffusion toy instead: a tiny SD3 transformer on 8x8 latents, its scheduler, "
                        "prompt embeddings and colour targets (kora_trainer/toys/diffusion.py)")
    p.add_argument("--diffusion-shape", default="toy", choices=["toy", "sd3-medium"],
                   help="with --diffusion: the transformer's shape, the CPU toy's or SD3-medium's (2B parameters, "
                        "random init: for a GPU)")
    p.add_argument("--sample-size", type=int, default=None,
                   help="with --diffusion: the latent side (default: the shape's own, 8 for the toy)")
    p.add_argument("--vl", action="store_true",
                   help="write the vision-language toy instead: a tiny Qwen3.5 with a vision tower naming the colour "
                        "of a generated image, its tokenizer, image processor and dataset (kora_trainer/toys/vl.py)")
    p.add_argument("--moe", action="store_true",
                   help="with --vl: the Qwen3.5-MoE variant (fused experts, router, shared expert in each layer)")
    p.set_defaults(func=_make_toy)


def _make_toy(args: argparse.Namespace) -> int:
    if args.diffusion:
        if args.target is not None:
            raise SystemExit("kora make-toy: --target is the LLM toy's pretraining goal; the diffusion toy is not "
                             "pretrained (drop --target or --diffusion)")
        from kora_trainer.toys.diffusion import make_diffusion_toy  # noqa: PLC0415 - a `kora` subcommand: the toy's torch stack loads only for make-toy

        info = make_diffusion_toy(args.dir, shape=args.diffusion_shape, sample_size=args.sample_size)
        print(json.dumps({"dir": args.dir, **info}))
        return 0
    if args.moe and not args.vl:
        raise SystemExit("kora make-toy: --moe is a variant of the vision-language toy; pass it with --vl")
    if args.vl:
        if args.diffusion:
            raise SystemExit("kora make-toy: --vl and --diffusion are two toys; pass one")
        from kora_trainer.toys.vl import make_vl_toy  # noqa: PLC0415 - a `kora` subcommand: the toy's torch stack loads only for make-toy

        print(json.dumps({"dir": args.dir, **make_vl_toy(args.dir, target=args.target, threads=args.threads,
                                                              moe=args.moe)}))
        return 0
    from kora_trainer.toys.lm import make_toy  # noqa: PLC0415 - a `kora` subcommand: the toy's torch stack loads only for make-toy

    info = make_toy(args.dir, target=args.target, threads=args.threads)
    print(json.dumps({"dir": args.dir, **info}))
    return 0
