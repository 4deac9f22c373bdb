"""The driver's bookkeeping, so that a recipe (recipes/) only says what happens: per-step curves, the progress line on
stdout, the control-plane progress the operator polls, the run's event file, and the final summary.

The event file (`<run dir>/events.jsonl`, SPEC's "trainer event file") holds one JSON object per line, each
with `event` and `wall_s` (seconds since the command started):
- `start`: backend, device, engines, sync mode, transport, the first push (`sync`) — the engines serve the
  initial (or restored) policy;
- `resume`: the step and checkpoint resumed from, and every newer checkpoint refused (`refused`, reasons);
- `step`: step, total, reward_mean, loss, clip_frac, train_ms (of it: logprob_ms, dp_allreduce_ms), gen_ms,
  tokens (prompt + response), samples, response_len, rollout_version_lag, rollout_logp_gap_max, lr, and the step's
  `sync` report (pushed, bytes, ms, adapter_version, path, note);
- `checkpoint`: step, path, ms;  `export`: step, path;  `stopped`: why the loop ended early;
- `summary`: the same object printed as the last line of stdout.
Tests read these events, not the log text.

The same step metrics go to the trackers `tracking:` turns on (tracking/: TensorBoard, W&B), under the names
docs/metrics.md lists, from `stepped` / `checkpointed` (and `adapter_stepped` for each adapter of a multi-adapter
job, its tags under `<adapter>/`) only. The control plane's progress gets the measured step rate and the ETA.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kora_trainer.backends.grpo_step import StepMetrics
from kora_trainer.config.status import rfc3339
from kora_trainer.control_plane import Progress
from kora_trainer.serving_check import ServingCheck
from kora_trainer.sync.sender import SyncReport
from kora_trainer.tracking import Sink, adapter_scalars, checkpoint_scalars, step_scalars

EVENT_FILE = "events.jsonl"
RATE_WINDOW = 20  # the ETA's step rate: the mean wall time of this many latest steps (a warm-up step ages out)


def human_duration(seconds: float) -> str:
    """4m10s, 1h02m, 2d03h: the ETA column's spelling (kubectl's own ages read alike)."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class StepRate:
    """Wall seconds per step over the last RATE_WINDOW steps, and the ETA it gives."""

    def __init__(self) -> None:
        self._durations: deque[float] = deque(maxlen=RATE_WINDOW)
        self._last: float | None = None

    def start(self) -> None:
        self._last = time.monotonic()

    def tick(self) -> float | None:
        """A step ended: its wall time since the previous one (None before start())."""
        now = time.monotonic()
        took = None if self._last is None else now - self._last
        self._last = now
        if took is not None:
            self._durations.append(took)
        return took

    def progress(self, step: int, total: int) -> dict[str, Any]:
        if not self._durations or not total:
            return {}
        per_step = statistics.fmean(self._durations)
        left = max(0, total - step) * per_step
        return {"secondsPerStep": round(per_step, 4), "estimatedRemainingSeconds": round(left),
                "eta": human_duration(left)}


def sync_paths(pushed: list[SyncReport]) -> dict[str, dict[str, Any]]:
    """Pushes and their median ms per sync path (http: the engine routes per bucket; fast: sync/fast/distributed.py)."""
    out = {}
    for path in dict.fromkeys(s.path for s in pushed):
        ms = [s.ms for s in pushed if s.path == path]
        out[path] = {"pushes": len(ms), "ms_p50": round(statistics.median(ms), 2)}
    return out


@dataclass
class Run:
    """What this process did: per-step curves, syncs, and where it started / checkpointed."""

    start: int = 0  # the step resumed from (0: a fresh start); the first step run is start + 1
    resumed: bool = False
    data_position: int = 0  # prompt batches taken for the steps done so far
    rewards: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)  # policy versions each step's rollouts lagged the trainer
    # per step: max |trainer log-prob - engine log-prob| of the sampled tokens before the first update (0 up to
    # kernel noise when the engines serve exactly the policy the trainer holds: the sync is right)
    logp_gaps: list[float | None] = field(default_factory=list)  # None: rollouts of an older version (async)
    syncs: list[SyncReport] = field(default_factory=list)
    saved_step: int | None = None  # the newest checkpoint's step
    export: str | None = None

    @property
    def done(self) -> int:  # the last step whose update is applied
        return self.start + len(self.rewards)


class StepRecorder:
    """Everything the driver records, to stdout, the control plane and the event file at once."""

    def __init__(self, run_dir: Path, steps: int, mode: str, t_start: float, serving: ServingCheck | None = None,
                 sinks: list[Sink] | None = None):
        self.steps, self.mode, self.t_start = steps, mode, t_start
        self.serving = serving
        self.sinks = sinks or []
        self.rate = StepRate()
        self.run = Run()
        self.progress = Progress(steps, mode)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / EVENT_FILE
        self._events = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed in close(); line-buffered)

    def wall_s(self) -> float:
        return round(time.monotonic() - self.t_start, 3)  # ms: the benches time steps by it

    def say(self, line: str) -> None:
        print(line, flush=True)

    def event(self, kind: str, **fields: Any) -> None:
        self._events.write(json.dumps({"event": kind, "wall_s": self.wall_s(), **fields}) + "\n")

    def resumed(self, info: dict[str, Any]) -> None:
        for reason in info["skipped"]:
            self.say(f"checkpoint refused, falling back to an older one: {reason}")
        r = self.run
        r.start, r.resumed, r.saved_step = info["step"], True, info["step"]
        self.say(f"resumed from checkpoint step {info['step']} ({info['path']})")
        saved = {"path": info["path"], "step": info["step"], "time": _written(info["path"])}
        self.progress.update(resumedFromStep=info["step"], step=info["step"], lastCheckpoint=saved)
        self.event("resume", step=info["step"], path=info["path"], refused=list(info["skipped"]))

    def started(self, info: dict[str, Any], engines: int, engine_kind: str, transport: str,
                first: SyncReport) -> None:
        self.progress.record_sync(first.as_dict(), step=self.run.start)
        self.progress.update(phase="Running")
        self.rate.start()  # the first step's time counts from here: its generation, update and sync
        ranks = info.get("ranks", [])
        where = ", ".join(f"rank {r['rank']} on {r['address']} ({r['device']})" for r in ranks)
        self.say(f"ready in {self.wall_s():.1f}s: {info['backend']} on {info['device']} x {info.get('world', 1)} "
                 f"rank(s), {engines} {engine_kind} engine(s), sync {self.mode} over {transport}, first push "
                 f"{first.bytes} B in {first.ms:.0f} ms" + (f"; {where}" if len(ranks) > 1 else ""))
        if first.note:
            self.say(f"sync: {first.note}")
        self.event("start", backend=info["backend"], device=info["device"], engines=engines, engine=engine_kind,
                   sync_mode=self.mode, transport=transport, sync=first.as_dict(), world=info.get("world", 1),
                   ranks=ranks, engine_urls=info.get("engine_urls", []))

    def stepped(self, step: int, metrics: StepMetrics, rstats: dict[str, Any], report: SyncReport) -> None:
        r = self.run
        r.rewards.append(metrics.reward_mean)
        r.losses.append(metrics.loss)
        r.lags.append(metrics.rollout_version_lag)
        r.logp_gaps.append(metrics.rollout_logp_gap_max)
        r.syncs.append(report)
        r.data_position = rstats["data_position"]
        self.progress.record_sync(report.as_dict(), step=step)
        step_s = self.rate.tick()
        self.progress.update(step=step, rewardMean=metrics.reward_mean, **self.rate.progress(step, self.steps))
        self.track(step_scalars(metrics.as_dict(), rstats["gen_ms"], report.as_dict(), step_s), step)
        self.say(self._progress_line(step, metrics, rstats, report))
        if report.note:
            self.say(f"sync: {report.note}")
        keys = ("reward_mean", "loss", "clip_frac", "train_ms", "dp_allreduce_ms", "logprob_ms", "tokens",
                "samples", "response_len", "rollout_version_lag", "rollout_logp_gap_max", "stale_logp_gap_max", "lr")
        self.event("step", step=step, total=self.steps, gen_ms=rstats["gen_ms"], sync=report.as_dict(),
                   **{k: getattr(metrics, k) for k in keys})
        if self.serving is not None:  # last: a PolicyNotServed leaves the step recorded
            check = self.serving.observe(step, metrics.version - 1, metrics.rollout_logp_gap_max,
                                         metrics.rollout_logp_gap_mean)
            if check is not None:
                self.progress.update(servingCheck=check)
            self.serving.verdict(check)

    def _progress_line(self, step: int, metrics: StepMetrics, rstats: dict[str, Any],
                       report: SyncReport) -> str:
        sync = f"{report.ms:.0f}ms {report.bytes}B v{report.adapter_version}" if report.pushed else "skipped"
        g = metrics.rollout_logp_gap_max
        gap = f"gap {g:.0e}" if g is not None else f"lag {metrics.rollout_version_lag}"
        return (f"step {step}/{self.steps} reward {metrics.reward_mean:.3f} loss {metrics.loss:.6g} | "
                f"gen {rstats['gen_ms'] / 1000:.2f}s train {metrics.train_ms / 1000:.2f}s "
                f"clip {metrics.clip_frac:.3f} {gap} | sync {sync} | {self.wall_s():.0f}s")

    def track(self, scalars: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(scalars, step)

    def adapter_stepped(self, metrics: dict[str, Any], gen_ms: float, sync: dict[str, Any]) -> None:
        """One adapter's step in a multi-adapter job: its event, and its series (tags under `<adapter>/`)."""
        self.event("adapter_step", adapter=metrics["name"], **metrics, gen_ms=gen_ms, sync=sync)
        self.track(adapter_scalars(metrics, gen_ms, sync), metrics["step"])

    def adapter_checkpointed(self, name: str, step: int, path: str, ms: float) -> None:
        self.event("adapter_checkpoint", adapter=name, step=step, path=path, ms=round(ms, 1))
        self.track(checkpoint_scalars(ms, prefix=f"{name}/"), step)

    def checkpointed(self, step: int, path: str, ms: float) -> None:
        self.run.saved_step = step
        self.progress.update(lastCheckpoint={"path": path, "step": step, "time": rfc3339()})
        self.track(checkpoint_scalars(ms), step)
        self.say(f"checkpoint step {step} -> {path} ({ms:.0f} ms)")
        self.event("checkpoint", step=step, path=path, ms=round(ms, 1))

    def exported(self, path: str, form: str = "HF-PEFT") -> None:
        self.run.export = path
        self.say(f"exported the adapter ({form}, step {self.run.done}) -> {path}")
        self.event("export", step=self.run.done, path=path)

    def stopped(self, why: str) -> None:
        self.progress.update(estimatedRemainingSeconds=0, eta=human_duration(0))  # this attempt runs no more steps
        self.say(why)
        self.event("stopped", step=self.run.done, why=why)

    def failed(self, e: BaseException) -> None:
        cause = getattr(e, "cause", None)  # a worker's error arrives wrapped in a RayTaskError
        shown = cause if isinstance(cause, BaseException) else e
        self.progress.update(phase="Failed", message=f"{type(shown).__name__}: {shown}"[:1000])

    def summary(self, transport: str | None, backend: str | None) -> dict[str, Any]:
        r = self.run
        pushed = [s for s in r.syncs if s.pushed]
        out = {
            "event": "summary", "steps": len(r.rewards), "first_step": r.start + 1,
            "resumed_from_step": r.start if r.resumed else None,
            "sync_mode": self.mode, "transport": transport, "backend": backend,
            "reward_first": round(statistics.fmean(r.rewards[:10]), 4) if r.rewards else None,
            "reward_last": round(statistics.fmean(r.rewards[-10:]), 4) if r.rewards else None,
            "sync_ms_p50": round(statistics.median(s.ms for s in pushed), 2) if pushed else None,
            "sync_paths": sync_paths(pushed),
            "sync_bytes_per_step": round(statistics.fmean(s.bytes for s in r.syncs)) if r.syncs else 0,
            "syncs_skipped": len(r.syncs) - len(pushed),
            "rollout_lag_max": max(r.lags, default=0),
            "rollout_logp_gap_max": max((g for g in r.logp_gaps if g is not None), default=None),
            "wall_s": self.wall_s(),
            "reward_curve": [round(x, 3) for x in r.rewards],
            "loss_curve": r.losses,  # unrounded: a resumed run's tail is compared with the uninterrupted one
            "last_checkpoint": self.progress.snapshot()["lastCheckpoint"], "export": r.export,
        }
        self._events.write(json.dumps(out) + "\n")
        self.say(json.dumps(out))
        return out

    def close(self) -> None:
        self._events.close()
        for sink in self.sinks:
            sink.close()


def _written(path: str) -> str | None:
    """When the checkpoint at `path` was written (its directory's mtime), for the checkpoint-age gauge."""
    try:
        return rfc3339(datetime.fromtimestamp(Path(path).stat().st_mtime, UTC))
    except OSError:
        return None


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The events a run wrote so far (a torn last line, mid-write, is left out)."""
    path = Path(run_dir) / EVENT_FILE
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
