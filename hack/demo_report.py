"""What `make demo` shows once its job is done: the reward curve in the terminal and a PNG of reward and sync
time per step, both read back from the job's TensorBoard event files with TensorBoard's own reader — the same
numbers `tensorboard --logdir` shows, so the picture is the tracking path's, not a second bookkeeping.

    python hack/demo_report.py .kora/demo/tensorboard [--png .kora/demo/reward_sync.png]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

REWARD_TAG = "critic/score/mean"  # tracking/names.py: verl's name for the mean sampled reward
SYNC_TAG = "timing_s/update_weights"  # the step's weight push, seconds
WINDOW = 10  # steps averaged at each end, as the first-10 -> last-10 reads


@dataclass(frozen=True)
class Curves:
    steps: list[int]
    reward: list[float]
    sync_ms: list[float]

    @property
    def first(self) -> float:
        return statistics.fmean(self.reward[:WINDOW])

    @property
    def last(self) -> float:
        return statistics.fmean(self.reward[-WINDOW:])


def read_curves(logdir: Path) -> Curves:
    """The reward and sync series of the (one) run whose event files are under `logdir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(logdir.rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files under {logdir}")
    acc = EventAccumulator(str(files[-1].parent), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    reward = {e.step: e.value for e in acc.Scalars(REWARD_TAG)}
    sync = {e.step: e.value * 1000 for e in acc.Scalars(SYNC_TAG)}
    steps = sorted(reward)
    return Curves(steps, [reward[s] for s in steps], [sync.get(s, float("nan")) for s in steps])


def terminal_chart(values: list[float], width: int = 60, height: int = 10, lo: float = 0.0, hi: float = 1.0) -> str:
    """A bar chart of `values` averaged into `width` columns, `height` rows of eighth-blocks between lo and hi
    (a few lines: a plotting dependency for one chart is not worth its weight)."""
    n = min(width, len(values))
    cols = [statistics.fmean(values[i * len(values) // n:(i + 1) * len(values) // n]) for i in range(n)]
    levels = [max(0.0, min(1.0, (v - lo) / (hi - lo))) * height for v in cols]
    blocks = " ▁▂▃▄▅▆▇█"
    rows = []
    for r in range(height - 1, -1, -1):
        label = f"{lo + (hi - lo) * (r + 1) / height:4.2f} │" if r in (height - 1, 0) or r == height // 2 else "     │"
        rows.append(label + "".join(blocks[max(0, min(8, round((lv - r) * 8)))] for lv in levels))
    rows.append("     └" + "─" * n)
    return "\n".join(rows)


def write_png(curves: Curves, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_s) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=[2, 1])
    ax_r.plot(curves.steps, curves.reward, lw=0.6, alpha=0.35, color="tab:blue", label="per step")
    k = max(1, len(curves.reward) // 50)
    smooth = [statistics.fmean(curves.reward[max(0, i - k):i + k + 1]) for i in range(len(curves.reward))]
    ax_r.plot(curves.steps, smooth, lw=2, color="tab:blue", label=f"mean of {2 * k + 1} steps")
    ax_r.set_ylabel("mean sampled reward")
    ax_r.set_ylim(0, 1)
    ax_r.set_title(f"toy-local: reward {curves.first:.2f} (first {WINDOW} steps) -> {curves.last:.2f} (last {WINDOW})")
    ax_r.legend(loc="lower right")
    ax_s.plot(curves.steps, curves.sync_ms, lw=0.8, color="tab:orange")
    ax_s.set_yscale("log")  # a p50 of milliseconds beside a few slow pushes on a busy machine
    ax_s.set_ylabel("weight sync (ms)")
    ax_s.set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(logdir: Path, png: Path) -> str:
    """The lines the demo prints at its end; writes the PNG."""
    curves = read_curves(logdir)
    write_png(curves, png)
    sync = [v for v in curves.sync_ms if v == v]
    return "\n".join([
        f"reward per step ({len(curves.steps)} steps, left to right):",
        terminal_chart(curves.reward),
        f"first {WINDOW} steps {curves.first:.3f} -> last {WINDOW} steps {curves.last:.3f} "
        f"({curves.last - curves.first:+.3f}); weight sync p50 {statistics.median(sync):.1f} ms",
        f"picture: {png}",
        f"TensorBoard: tensorboard --logdir {logdir}  (then open http://127.0.0.1:6006)",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logdir", type=Path)
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()
    print(report(args.logdir, args.png or args.logdir.parent / "reward_sync.png"))


if __name__ == "__main__":
    main()
