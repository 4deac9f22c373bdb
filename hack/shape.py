#!/usr/bin/env python3
"""Print the shape of the code: the largest files, the longest functions, and the import edges between the
trainer's packages (with any cycle). Run it on two checkouts to compare a restructuring.

    python hack/shape.py [ROOT] [--top 10]
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

TREES = ("operator", "trainer", "engine", "cli", "bench")


def functions(tree: ast.AST) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out.append((node.name, (node.end_lineno or node.lineno) - node.lineno + 1))
    return out


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "kora_trainer" and len(parts) > 1 else None


def imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every simple cycle's first occurrence in a depth-first walk (the graph is small)."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt in path:
                cyc = path[path.index(nxt):]
                if frozenset(cyc) not in seen:
                    seen.add(frozenset(cyc))
                    found.append([*cyc, nxt])
            elif len(path) < 12:
                walk(nxt, [*path, nxt])

    for start in sorted(edges):
        walk(start, [start])
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args(argv)
    sizes, funcs, edges = [], [], defaultdict(set)
    for tree_name in TREES:
        for f in sorted((args.root / tree_name).rglob("*.py")):
            rel = f.relative_to(args.root).as_posix()
            text = f.read_text()
            tree = ast.parse(text)
            sizes.append((len(text.splitlines()), rel))
            funcs += [(n, f"{rel}::{name}") for name, n in functions(tree)]
            if rel.startswith("trainer/kora_trainer/"):
                mod = ".".join(f.relative_to(args.root / "trainer").with_suffix("").parts)
                src = package_of(mod)
                for target in imports(tree):
                    dst = package_of(target)
                    if src and dst and dst != src:
                        edges[src].add(dst)
    print(f"largest files (lines), top {args.top}:")
    for n, rel in sorted(sizes, reverse=True)[:args.top]:
        print(f"  {n:6d}  {rel}")
    print(f"longest functions (lines), top {args.top}:")
    for n, where in sorted(funcs, reverse=True)[:args.top]:
        print(f"  {n:6d}  {where}")
    trainer = sorted(n for n, rel in sizes if rel.startswith("trainer/"))
    print(f"largest file in trainer/: {trainer[-1] if trainer else 0} lines")
    print("kora_trainer package imports:")
    for src in sorted(edges):
        print(f"  {src} -> {', '.join(sorted(edges[src]))}")
    found = cycles(edges)
    print("package-level cycles: " + ("; ".join(" -> ".join(c) for c in found) if found else "none"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
