"""Print the cProfile totals bench/sync_profile/sitecustomize.py wrote: per file, the pushes' cumulative time by
function (the top N), so two runs (two commits, two modes) can be read side by side.

    python bench/sync_profile/report.py DIR [--top 25] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import pstats
from pathlib import Path


def summary(path: Path, top: int) -> dict[str, object]:
    stats = pstats.Stats(str(path))
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({func})", "calls": nc, "own_ms": round(tt * 1000, 3),
                     "cum_ms": round(ct * 1000, 3)})
    rows.sort(key=lambda r: -float(r["cum_ms"]))  # type: ignore[arg-type]
    syncs = [r for r in rows if str(r["function"]).endswith("(sync)")]
    return {"file": path.name, "pushes": syncs[0]["calls"] if syncs else 0, "top": rows[:top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = [summary(p, args.top) for p in sorted(args.dir.glob("sync-*.prof"))]
    for s in out:
        print(f"== {s['file']}: {s['pushes']} pushes")
        for r in s["top"]:  # type: ignore[attr-defined]
            print(f"  {r['cum_ms']:10.3f} ms cum {r['own_ms']:10.3f} own {r['calls']:6d}x  {r['function']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
