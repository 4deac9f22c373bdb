"""`kora <command>`: subcommands come from the `kora.commands` entry-point group.

Each entry point names a function `register(subparsers)` that adds one subcommand and sets
`func` on it. The operator wing contributes validate/render/operator, the trainer wing
merge/make-toy; this module imports neither, so their import rules stay intact, and a trainer-only
image simply has fewer subcommands.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kora", description="LoRA RL post-training on Kubernetes")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for ep in sorted(entry_points(group="kora.commands"), key=lambda e: e.name):
        try:
            register = ep.load()
        except ImportError as e:  # a wing whose extra is not installed
            sub.add_parser(ep.name, help=f"(unavailable: {e.name} is not installed)")
            continue
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        print(f"kora {args.command}: this install lacks what the command needs "
              "(pip install 'kora[operator]' or 'kora[trainer]')", file=sys.stderr)
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
