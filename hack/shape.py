#!/usr/bin/env python3
"""Print the shape of a checkout, to compare a restructuring before and after: the packages of kora_trainer,
kora_operator and kora_engine (when the checkout has engine/kora_engine) and the import edges between them; the
file circles (import cycles between modules); how many imports sit inside functions; the longest functions; the
largest files; and the functions over complexity 15.

    python hack/shape.py [ROOT] [--top 10] [--max-complexity 15]

Stdlib only, apart from running ruff (found next to this Python, on PATH, or as ROOT/.venv/bin/ruff) for the
complexity: ruff's C901 (McCabe as ruff counts it: one plus each if/elif, loop, except clause and match case;
`and`/`or` not counted). A second count, made here, adds each extra operand of `and`/`or` and each comprehension
and its `if`s (as radon, and the issue that asked for this tool, count), so a condition packed into a line shows.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# where each top-level package lives in a checkout: (source tree, package directory)
PACKAGES = {"kora_trainer": "trainer", "kora_operator": "operator", "kora_engine": "engine", "kora_cli": "cli"}
GRAPHED = ("kora_trainer", "kora_operator", "kora_engine")  # the packages whose rooms and edges are drawn
CODE_TREES = ("operator", "trainer", "engine", "cli")  # the product code that files and functions are ranked over


@dataclass
class Module:
    name: str  # dotted, e.g. kora_operator.handlers.jobs
    rel: str  # path inside the checkout
    lines: int
    tree: ast.Module
    top_imports: set[str] = field(default_factory=set)  # module-level (what runs on import)
    nested_imports: set[str] = field(default_factory=set)  # inside a function
    nested_count: int = 0  # import statements inside functions


@dataclass(frozen=True)
class Function:
    qualname: str
    rel: str
    line: int
    lines: int
    complexity: int  # the radon-like count (boolean operands and comprehension ifs included)


# -- reading the checkout ---------------------------------------------------------------------------------------


def load(root: Path) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package, tree_dir in PACKAGES.items():
        base = root / tree_dir
        if not (base / package).is_dir():
            continue
        for f in sorted((base / package).rglob("*.py")):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            text = f.read_text(encoding="utf-8")
            name = ".".join(parts)
            modules[name] = Module(name, f.relative_to(root).as_posix(), len(text.splitlines()),
                                   ast.parse(text, filename=str(f)))
    for mod in modules.values():
        _collect_imports(mod, modules)
    return modules


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _resolve(mod: Module, node: ast.Import | ast.ImportFrom, known: dict[str, Module]) -> set[str]:
    """The kora modules an import statement loads (`from a import b` is the module a.b when there is one)."""
    if isinstance(node, ast.Import):
        return {_known_prefix(a.name, known) for a in node.names} - {""}
    base = node.module or ""
    if node.level:
        pkg = mod.name.split(".")
        is_pkg = mod.rel.endswith("__init__.py")
        anchor = pkg if is_pkg else pkg[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    out = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.add(sub if sub in known else _known_prefix(base, known))
    return out - {""}


def _known_prefix(name: str, known: dict[str, Module]) -> str:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return ""


def _collect_imports(mod: Module, known: dict[str, Module]) -> None:
    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:  # the TYPE_CHECKING branch never runs: no edge, no circle
                    visit(sub, in_function)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                targets = _resolve(mod, child, known) - {mod.name}
                if in_function:
                    mod.nested_count += 1
                    mod.nested_imports |= targets
                else:
                    mod.top_imports |= targets
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(mod.tree, False)


def room(module: str) -> str:
    """The package a module belongs to for the drawing: kora_x.<first part> (a top-level module is its own)."""
    parts = module.split(".")
    return ".".join(parts[:2])


# -- complexity and length ---------------------------------------------------------------------------------------


def radon_like(fn: ast.AST) -> int:
    """1 + each branch point inside `fn` (not inside functions nested in it): if/elif, conditional expression,
    loop (and its else), except clause (and try's else), match case, extra operand of and/or, comprehension (and
    each of its ifs), assert."""
    score = 1
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.If | ast.IfExp | ast.Assert | ast.match_case):
            score += 1
        elif isinstance(node, ast.For | ast.AsyncFor | ast.While):
            score += 1 + bool(node.orelse)
        elif isinstance(node, ast.Try):
            score += len(node.handlers) + bool(node.orelse)
        elif isinstance(node, ast.BoolOp):
            score += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            score += 1 + len(node.ifs)
        stack.extend(ast.iter_child_nodes(node))
    return score


def functions(rel: str, tree: ast.Module) -> list[Function]:
    out: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                q = f"{prefix}{child.name}"
                n = (child.end_lineno or child.lineno) - child.lineno + 1
                out.append(Function(q, rel, child.lineno, n, radon_like(child)))
                visit(child, q + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def code_files(root: Path) -> list[tuple[str, int, ast.Module]]:
    out = []
    for tree_dir in CODE_TREES:
        for f in sorted((root / tree_dir).rglob("*.py")) if (root / tree_dir).is_dir() else ():
            text = f.read_text(encoding="utf-8")
            out.append((f.relative_to(root).as_posix(), len(text.splitlines()), ast.parse(text)))
    return out


def find_ruff(root: Path) -> str | None:
    for candidate in (Path(sys.executable).parent / "ruff", root / ".venv" / "bin" / "ruff"):
        if candidate.exists():
            return str(candidate)
    return shutil.which("ruff")


def ruff_c901(root: Path, limit: int) -> list[str] | str:
    """ruff's C901 findings over the product code (noqa comments ignored), or why it could not run."""
    ruff = find_ruff(root)
    if ruff is None:
        return "ruff not found"
    trees = [t for t in CODE_TREES if (root / t).is_dir()]
    cmd = [ruff, "check", "--no-cache", "--ignore-noqa", "--select", "C901", "--output-format", "json",
           "--config", f"lint.mccabe.max-complexity={limit}", *trees]
    got = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
    try:
        found = json.loads(got.stdout or "[]")
    except json.JSONDecodeError:
        return f"ruff failed: {got.stderr.strip()[:300]}"
    out = []
    for f in sorted(found, key=lambda f: (f["filename"], f["location"]["row"])):
        rel = Path(f["filename"]).resolve().relative_to(root.resolve()).as_posix()
        out.append(f"{rel}:{f['location']['row']}  {f['message']}")
    return out


# -- graph -------------------------------------------------------------------------------------------------------


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one node (or a node importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]
    nodes = sorted(set(edges) | {d for ds in edges.values() for d in ds})
    sys.setrecursionlimit(max(10000, 4 * len(nodes)))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return sorted(out)


def shortest_cycle(edges: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the component's first node (breadth first, inside the component)."""
    inside, start = set(comp), comp[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w in inside and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


# -- report ------------------------------------------------------------------------------------------------------


def report(root: Path, top: int, limit: int) -> None:
    modules = load(root)
    print(f"shape of {root.resolve()}")
    present = [p for p in GRAPHED if any(m == p or m.startswith(p + ".") for m in modules)]
    print(f"\npackages (kora_x.<first part>; a top-level module is its own), graphed: {', '.join(present)}")
    rooms: dict[str, set[str]] = defaultdict(set)
    sizes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for mod in modules.values():
        src = room(mod.name)
        if src.split(".")[0] not in GRAPHED:
            continue
        sizes[src][0] += 1
        sizes[src][1] += mod.lines
        for target in mod.top_imports | mod.nested_imports:
            dst = room(target)
            if dst != src:
                rooms[src].add(dst)
    for src in sorted(sizes):
        files, lines = sizes[src]
        print(f"  {src}  ({files} files, {lines} lines) -> {', '.join(sorted(rooms[src])) or '-'}")
    room_cycles = strongly_connected(rooms)
    print(f"package circles (imports inside functions included): {len(room_cycles)}")
    for comp in room_cycles:
        print("  " + " -> ".join(shortest_cycle(rooms, comp)) + f"   [{len(comp)} packages in the circle]")

    every: dict[str, set[str]] = {m.name: m.top_imports | m.nested_imports for m in modules.values()}
    top_only: dict[str, set[str]] = {m.name: set(m.top_imports) for m in modules.values()}
    circles = strongly_connected(every)
    hidden = [c for c in circles if c not in strongly_connected(top_only)]
    print(f"\nfile circles (module import cycles; imports inside functions included, `if TYPE_CHECKING:` left out): "
          f"{len(circles)} ({len(hidden)} of them only through imports inside functions)")
    for comp in circles:
        mark = "  [only through imports inside functions]" if comp in hidden else ""
        print("  " + " -> ".join(shortest_cycle(every, comp)) + (f"   [{len(comp)} files]" if len(comp) > 2 else "")
              + mark)

    nested: dict[str, int] = defaultdict(int)
    for mod in modules.values():
        nested[mod.name.split(".")[0]] += mod.nested_count
    print(f"\nimports inside functions: {sum(nested.values())} ("
          + ", ".join(f"{p} {n}" for p, n in sorted(nested.items())) + ")")

    code = code_files(root)
    funcs = [f for rel, _, tree in code for f in functions(rel, tree)]
    print(f"\nlongest functions (lines; over {', '.join(CODE_TREES)}), top {top}:")
    for f in sorted(funcs, key=lambda f: (-f.lines, f.rel, f.line))[:top]:
        print(f"  {f.lines:5d}  {f.rel}:{f.line} {f.qualname}")
    for tree_dir in CODE_TREES:
        mine = [f for f in funcs if f.rel.startswith(tree_dir + "/")]
        if mine:
            print(f"  {tree_dir}/: {len(mine)} functions, {sum(f.lines > 60 for f in mine)} over 60 lines, "
                  f"the longest {max(f.lines for f in mine)}")
    print(f"\nlargest files (lines), top {top}:")
    for rel, n, _ in sorted(code, key=lambda t: (-t[1], t[0]))[:top]:
        print(f"  {n:5d}  {rel}")

    found = ruff_c901(root, limit)
    print(f"\ncomplexity over {limit}, ruff C901 (McCabe; noqa ignored): "
          + (found if isinstance(found, str) else str(len(found))))
    for line in found if isinstance(found, list) else ():
        print(f"  {line}")
    over = sorted((f for f in funcs if f.complexity > limit), key=lambda f: (-f.complexity, f.rel))
    print(f"complexity over {limit}, counted here (McCabe + each extra and/or operand + comprehension ifs): "
          f"{len(over)}")
    for f in over:
        print(f"  {f.complexity:3d}  {f.rel}:{f.line} {f.qualname}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--max-complexity", type=int, default=15)
    args = p.parse_args(argv)
    report(args.root, args.top, args.max_complexity)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
