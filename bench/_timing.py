"""The benches' one timer (bench/gpu_sync.py, gpu_sync_colocated.py, gpu_fold.py) and their phase runner.

- `event_ms`: the median CUDA-event time of a launch sequence on the current stream (GPU time, no host wait);
- `wall_ms`: the median host wall time of a call with the device synchronised before and after it;
- `loop_ms`: host wall times of a body run n times, each after an untimed `before` (the "trainer step done"
  pattern: the step is outside the timed span, the push inside it);
- `run_phase`: one named measurement: its seconds in res["phase_s"], a failure's traceback in res["errors"]
  (printed; the next phase still runs unless `on_error` raises).
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def sync_dev(device: torch.device) -> None:
    """Wait for everything queued on `device` (every stream); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_stream(device: torch.device) -> None:
    """Wait for the current stream of `device` only (work on side streams may still run); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def wall_ms(fn: Callable[[], Any], reps: int, device: torch.device, warmup: int = 2) -> tuple[float, list[float]]:
    """(median, every) host wall time (ms) of fn(), the device synchronised before and after each call."""
    for _ in range(warmup):
        fn()
        sync_dev(device)
    times = []
    for _ in range(reps):
        sync_dev(device)
        t0 = time.perf_counter()
        fn()
        sync_dev(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def event_ms(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median CUDA-event time (ms) of fn() on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return float(statistics.median(times))


def loop_ms(n: int, body: Callable[[int], Any], before: Callable[[int], Any] | None = None) -> list[float]:
    """Host wall time (ms) of body(i) for i in range(n), each after an untimed before(i)."""
    times = []
    for i in range(n):
        if before is not None:
            before(i)
        t0 = time.perf_counter()
        body(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def run_phase(res: dict[str, Any], name: str, fn: Callable[[], Any], where: str = "", verbose: bool = True,
              on_error: Callable[[str, Exception], None] | None = None) -> None:
    """Run fn() as phase `name`. A failure: its traceback in res["errors"][name], printed (`where` after FAILED),
    then `on_error(name, exc)` (which may raise: the phase then records no time). Otherwise the phase's seconds go
    to res["phase_s"][name] (printed when `verbose`)."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:
        res["errors"][name] = traceback.format_exc()[-3000:]
        print(f"[{name}] FAILED{where}\n{res['errors'][name]}", flush=True)
        if on_error is not None:
            on_error(name, e)
    res.setdefault("phase_s", {})[name] = round(time.perf_counter() - t0, 1)
    if verbose:
        print(f"[{name}] {res['phase_s'][name]} s", flush=True)
