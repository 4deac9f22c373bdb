"""`make demo`'s closing report: the curve read back from real TensorBoard event files (written here by the
same SummaryWriter the trainer's tracking uses), the terminal chart and the PNG."""

from __future__ import annotations

import statistics

import pytest

from demo_report import REWARD_TAG, SYNC_TAG, read_curves, report, terminal_chart

pytest.importorskip("matplotlib")


def write_run(logdir, rewards, sync_s):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(logdir))
    for step, (r, s) in enumerate(zip(rewards, sync_s, strict=True), start=1):
        w.add_scalar(REWARD_TAG, r, step)
        w.add_scalar(SYNC_TAG, s, step)
        w.add_scalar("actor/pg_loss", 0.1, step)  # another tag: not read
    w.close()


def test_the_report_reads_the_event_files_and_draws_the_curve(tmp_path):
    rewards = [0.1 + 0.02 * i for i in range(30)]  # rises from 0.10 to 0.68
    write_run(tmp_path / "tb", rewards, [0.004 + 0.0001 * i for i in range(30)])
    png = tmp_path / "out" / "reward_sync.png"
    text = report(tmp_path / "tb", png)
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    assert f"first 10 steps {first:.3f} -> last 10 steps {last:.3f} (+{last - first:.3f})" in text
    assert "30 steps" in text and f"tensorboard --logdir {tmp_path / 'tb'}" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    curves = read_curves(tmp_path / "tb")
    assert curves.steps == list(range(1, 31))
    assert curves.sync_ms[0] == pytest.approx(4.0, rel=1e-5) and curves.sync_ms[-1] == pytest.approx(6.9, rel=1e-5)


def test_the_terminal_chart_rises_with_the_reward():
    rising = terminal_chart([i / 59 for i in range(60)], width=60, height=10).splitlines()
    bars = rising[:-1]  # the axis line last
    heights = [sum(row[6 + c] != " " for row in bars) for c in range(60)]
    assert heights == sorted(heights) and heights[0] <= 1 and heights[-1] == 10
    flat = terminal_chart([0.0] * 60).splitlines()[:-1]
    assert all(set(row[6:]) <= {" "} for row in flat)


def test_no_event_files_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no TensorBoard event files under"):
        read_curves(tmp_path)
