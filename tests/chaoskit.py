"""The trainer under faults: one job (the toy, checkpoint every step, deployment.async false) run attempt after
attempt on one checkpoint.path, each attempt ended by a fault, until a last attempt finishes; beside it the same
job uninterrupted. Shared by tests/e2e/test_chaos_trainer.py (a CI-sized plan) and bench/chaos_trainer.py (>= 20
trainer kills).

Faults (what ends an attempt):
- `startup`: the trainer's whole session (driver, Ray, workers, engine) SIGKILLed at a random moment of its
  first 25 s (loading, Ray start, the first push);
- `steps`: SIGKILLed a random 0-2.5 s after it reported ready (inside some step: generate, update, sync or
  checkpoint write);
- `write`: the checkpoint writer SIGKILLs itself inside its 1st-3rd write, with every file in the temp dir
  or just after the rename, before `latest` moves (checkpoint/faults.py: the ~50 ms a write takes on the toy
  cannot be hit from outside on a loaded machine), and the rest of the trainer is SIGKILLed the moment the
  writer is seen dead;
- `engine-generate` / `engine-sync`: the engine SIGKILLs itself on its n-th /generate or fast-path push
  (kora_engine/faults.py: exactly inside the call); the trainer must fail the attempt, naming the engine,
  within the bound, not hang;
- `engine-hang-generate` / `engine-hang-sync`: the engine hangs without dying inside its n-th /generate, or
  inside a push (the first one, on the HTTP path, or the n-th fast-path one): it SIGSTOPs itself, or wedges its
  event loop (running, still accepting connections, answering nothing), the two kinds in turn; the trainer's
  hang watch must kill it and fail the attempt with EngineLost saying it hung, within HANG_S plus NOTICE_SLACK_S
  of the hang (timed from the engine's own mark in its log to the Failed phase on /status);
- `disk`: checkpoint.path's tmpfs shrunk to less than one more checkpoint: the attempt must fail naming ENOSPC,
  `latest` unchanged; the tmpfs is grown back before the next attempt.

Checked on every attempt: before it starts, the checkpoint it must resume from is computed from the disk (what
`lora_only.load_latest` must pick: `latest` if it verifies, else the newest that does; torn writes listed apart)
and its adapter read; the attempt's `resume` event must name exactly it, and that adapter must equal the
uninterrupted run's checkpoint of the same step bit for bit (a torn or wrong checkpoint would differ); every
step the attempt ran must have the uninterrupted run's loss and reward exactly; at the end the final adapter
must equal the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kora_engine.faults import EXIT_AT_ENV, HANG_AT_ENV, HANG_MARK
from kora_trainer.checkpoint import lora_only
from kora_trainer.checkpoint.faults import KILL_AT_ENV, PHASES
from tmpfskit import mounted_tmpfs, resize_tmpfs
from trainkit import TrainRun, _session_pids

FAULTS = ("startup", "steps", "write", "engine-generate", "engine-sync", "engine-hang-generate", "engine-hang-sync",
          "disk")
TRAINER_KILLS = ("startup", "steps", "write")
HANG_S = 8  # rollout.engineHangSeconds of these runs: short, so a hang costs an attempt seconds, not the default 60
NOTICE_SLACK_S = 10.0  # beyond HANG_S: a probe interval, the death path's seconds, /status polling, a loaded machine
JOB = ["deployment.async=false", "checkpoint.interval=1", "sync.deltaSkipThreshold=0",
       f"rollout.engineHangSeconds={HANG_S}"]
KEEP = 2
ATTEMPT_TIMEOUT_S = 300.0  # an attempt that neither finishes nor fails in this long is a hang (a problem)
NOTICE_BOUND_S = 120.0  # the weight-update group's timeout (wire/group.py): an engine death noticed later is a hang
TMPFS_SIZE = "256M"


def steps_for(plan: list[str]) -> int:
    """The job's numSteps: room for every fault to meet a running job (a `steps` kill lands up to ~12 toy steps
    in, measured; most faults far fewer), so no attempt finds the job already done."""
    return 8 * len(plan) + 10


@dataclass
class Attempt:
    index: int
    fault: str  # what ended it ("none": the last one, run to the end)
    expected_step: int | None  # the checkpoint it had to resume from (None: none on disk)
    resumed_step: int | None = None  # the one it did resume from (its `resume` event)
    steps: list[int] = field(default_factory=list)
    torn_before: list[str] = field(default_factory=list)  # torn writes on disk when it started (never loaded)
    loaded: bool = False  # it got as far as loading a checkpoint (or finding none)
    during_write: bool = False  # the kill left a checkpoint write unfinished (a temp dir, or `latest` not moved)
    fault_at: str = ""  # an injected fault's setting (the engine's or the checkpoint writer's environment)
    notice_s: float | None = None  # engine faults: from the engine's death (or hang) to the trainer's Failed phase
    message: str = ""  # what the attempt said when it failed (engine and disk faults)
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)


@dataclass
class ChaosResult:
    steps: int
    attempts: list[Attempt]
    final_equal: bool
    reference_s: float
    chaos_s: float
    tmpfs: str  # "" when checkpoint.path was a plain directory (no tmpfs: the disk fault did not run)

    def problems(self) -> list[str]:
        out = [f"attempt {a.index} ({a.fault}): {p}" for a in self.attempts for p in a.problems]
        return out + ([] if self.final_equal else ["the final adapter differs from the uninterrupted run's"])

    def figures(self) -> dict[str, Any]:
        faults = [a for a in self.attempts if a.fault != "none"]
        kills = [a for a in faults if a.fault in TRAINER_KILLS]
        engine = [a for a in faults if a.fault in ("engine-generate", "engine-sync")]
        notice = [a.notice_s for a in engine if a.notice_s is not None]
        hangs = [a for a in faults if a.fault.startswith("engine-hang")]
        hang_notice = [a.notice_s for a in hangs if a.notice_s is not None]
        return {
            "steps": self.steps, "attempts": len(self.attempts),
            "trainer_kills": len(kills), **{f"kills_{k}": sum(a.fault == k for a in kills) for k in TRAINER_KILLS},
            "kills_during_checkpoint_write": sum(a.during_write for a in kills),
            "restarts": len(self.attempts) - 1,
            "resumes_from_verified_checkpoint": sum(a.resumed_step is not None and not a.problems
                                                    for a in self.attempts),
            "fresh_starts": sum(a.loaded and a.expected_step is None for a in self.attempts),
            "killed_before_loading": sum(not a.loaded for a in self.attempts),
            "torn_writes_seen_on_disk": sum(len(a.torn_before) for a in self.attempts),
            "torn_loaded": sum(a.resumed_step is not None and a.resumed_step != a.expected_step
                               for a in self.attempts),
            "engine_kills_mid_generate": sum(a.fault == "engine-generate" for a in engine),
            "engine_kills_mid_sync": sum(a.fault == "engine-sync" for a in engine),
            "engine_notice_s_max": max(notice) if notice else None,
            "engine_hangs_mid_generate": sum(a.fault == "engine-hang-generate" for a in hangs),
            "engine_hangs_mid_sync": sum(a.fault == "engine-hang-sync" for a in hangs),
            "engine_hang_s": HANG_S,
            "engine_hang_notice_s": hang_notice,  # each hang's, from the engine's mark to the Failed phase
            "engine_hang_notice_s_max": max(hang_notice) if hang_notice else None,
            "disk_full_attempts": sum(a.fault == "disk" for a in faults),
            "steps_run_in_all": sum(len(a.steps) for a in self.attempts),
            "steps_differing_from_uninterrupted": sum("differs from the uninterrupted" in p
                                                      for a in self.attempts for p in a.problems),
            "final_adapter_equal": self.final_equal, "problems": len(self.problems()),
            "reference_s": round(self.reference_s, 1), "chaos_s": round(self.chaos_s, 1),
        }

    def as_dict(self) -> dict[str, Any]:
        return {"figures": self.figures(), "problems": self.problems(), "tmpfs": self.tmpfs,
                "attempts": [asdict(a) for a in self.attempts]}


def _adapter(step_dir: Path) -> dict[str, torch.Tensor]:
    return lora_only.load_dir(step_dir).adapter  # as the run held it (the file is in checkpoint.dtype)


def disk_state(root: Path) -> tuple[Path | None, list[str]]:
    """(the checkpoint a resume must load, torn writes): `latest` if it verifies, else the newest that does."""
    torn = [p.name for p in root.glob(".step_*.tmp-*")]
    good = []
    for d in sorted(root.glob("step_*"), reverse=True):
        try:
            lora_only.verify(d)
            good.append(d)
        except lora_only.CheckpointError:
            torn.append(d.name)
    pointer = root / lora_only.LATEST
    named = root / pointer.read_text().strip() if pointer.exists() else None
    if named in good:
        return named, torn
    return (good[0] if good else None), torn


def _write_unfinished(root: Path) -> bool:
    """A kill inside a checkpoint write leaves a temp dir, the pointer's temp file, or a step dir newer than
    `latest` (renamed, pointer not yet moved)."""
    if any(root.glob(".step_*.tmp-*")) or (root / f".{lora_only.LATEST}.tmp").exists():
        return True
    pointer, steps = root / lora_only.LATEST, sorted(p.name for p in root.glob("step_*"))
    return bool(steps) and (not pointer.exists() or pointer.read_text().strip() != steps[-1])


def _started(run: TrainRun) -> bool:
    return bool(run.events("start"))


def _wait(cond: Any, run: TrainRun, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Bounded: until cond() holds or the run exits; whether cond() held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        if not run.running():
            return bool(cond())
        time.sleep(poll_s)
    return bool(cond())


def _kill_now(run: TrainRun, pids: list[int]) -> None:
    """SIGKILL the pids taken beforehand at once (no /proc walk between the trigger and the kill), then the rest
    of the session (TrainRun.kill: stragglers, Ray's temp dir)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run.kill()


def _engine_pid(run: TrainRun) -> int | None:
    for pid in _session_pids(run.proc.pid):
        with contextlib.suppress(OSError):
            if b"kora_engine.lm" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


class Chaos:
    def __init__(self, toy_dir: Path, work: Path, steps: int, seed: int = 0):
        self.toy_dir, self.work, self.steps = toy_dir, work, steps
        self.rng = random.Random(seed)
        self.ckpt, self.ref_ckpt = work / "ckpt", work / "ref-ckpt"
        self.attempts: list[Attempt] = []
        self.ref_steps: dict[int, tuple[float, float]] = {}
        self.resumed_adapters: dict[int, dict[str, torch.Tensor]] = {}  # attempt -> the checkpoint it had to load

    def job(self, ckpt: Path, keep: int) -> list[str]:
        return [*JOB, f"algorithm.numSteps={self.steps}", f"checkpoint.keep={keep}", f"checkpoint.path={ckpt}"]

    def run(self, plan: list[str]) -> ChaosResult:
        unknown = sorted(set(plan) - set(FAULTS))
        if unknown:
            raise ValueError(f"unknown faults {unknown}: choose from {FAULTS}")
        with contextlib.ExitStack() as stack:
            tmpfs = ""
            try:  # the disk fault needs checkpoint.path on a filesystem the test can shrink
                stack.enter_context(mounted_tmpfs(self.ckpt, TMPFS_SIZE, skip=False))
                tmpfs = TMPFS_SIZE
            except RuntimeError:
                plan = [f for f in plan if f != "disk"]
            t0 = time.monotonic()
            ref = TrainRun(self.toy_dir, self.work / "reference", *self.job(self.ref_ckpt, self.steps + 1))
            try:
                for fault in [*plan, "none"]:
                    self.attempt(fault, ref)
                _finish(ref, ATTEMPT_TIMEOUT_S)
            finally:
                if ref.running():
                    ref.kill()
            chaos_s = time.monotonic() - t0
            ref_s = _wall(ref)
            self.ref_steps = {e["step"]: (e["loss"], e["reward_mean"]) for e in ref.events("step")}
            for a in self.attempts:
                self.check_steps(a)
            final = self.steps
            want, got = _adapter(self.ref_ckpt / lora_only.step_dir_name(final)), None
            with contextlib.suppress(OSError):
                got = _adapter(self.ckpt / lora_only.step_dir_name(final))
            equal = got is not None and want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
            self.check_resumed_adapters()
            return ChaosResult(self.steps, self.attempts, equal, ref_s, chaos_s, tmpfs)

    def attempt(self, fault: str, ref: TrainRun) -> None:
        expected, torn = disk_state(self.ckpt) if self.ckpt.is_dir() else (None, [])
        a = Attempt(len(self.attempts), fault, _step_of(expected), torn_before=torn)
        self.attempts.append(a)
        if expected is not None:  # read now: the attempt prunes it soon after loading it
            self.resumed_adapters[a.index] = _adapter(expected)
        env: dict[str, str] = {}
        if fault == "engine-generate":
            env[EXIT_AT_ENV] = f"/generate:{self.rng.randint(2, 4)}"
        elif fault == "write":
            env[KILL_AT_ENV] = f"{self.rng.choice(PHASES)}:{self.rng.randint(1, 3)}"
        elif fault == "engine-sync":
            env[EXIT_AT_ENV] = f"/kora/fast_sync/push:{self.rng.randint(2, 4)}"
        elif fault.startswith("engine-hang"):
            env[HANG_AT_ENV] = self.hang_at(fault)
        elif fault == "disk":
            trouble = self.shrink_disk()
            if trouble:
                a.problems.append(trouble)
                a.fault = "disk-not-run"
        a.fault_at = " ".join(f"{k}={v}" for k, v in env.items())
        t0 = time.monotonic()
        run = TrainRun(self.toy_dir, self.work / f"attempt-{a.index:02d}", *self.job(self.ckpt, KEEP), env=env)
        try:
            self.inflict(a, run)
        finally:
            if run.running():
                run.kill()
            if fault == "disk":  # back to its size, whether or not the shrink took
                resize_tmpfs(self.ckpt, TMPFS_SIZE)
        a.wall_s = round(time.monotonic() - t0, 2)
        resumed = run.events("resume")
        a.resumed_step = resumed[0]["step"] if resumed else None
        a.steps = run.steps()
        # a kill during startup may land before the trainer looked for a checkpoint: nothing to check then
        a.loaded = bool(resumed) or "no checkpoint under" in run.output
        if a.loaded and a.resumed_step != a.expected_step:
            a.problems.append(f"resumed from step {a.resumed_step}, the disk's newest good checkpoint was "
                              f"{a.expected_step}")
        if fault == "none":
            try:
                run.summary()  # exit 0 and the summary line
            except AssertionError as e:
                a.problems.append(f"the last attempt did not finish: {str(e)[-1500:]}")

    def inflict(self, a: Attempt, run: TrainRun) -> None:
        if a.fault == "startup":
            deadline = time.monotonic() + self.rng.uniform(1.0, 25.0)
            _wait(lambda: time.monotonic() >= deadline, run, 30)
            _kill_now(run, _session_pids(run.proc.pid))
            a.during_write = _write_unfinished(self.ckpt)
        elif a.fault in ("steps", "write"):
            if not _wait(lambda: _started(run), run, ATTEMPT_TIMEOUT_S):
                a.problems.append(f"never ready:\n{run.output[-1500:]}")
                return
            pids = _session_pids(run.proc.pid)
            if a.fault == "steps":
                deadline = time.monotonic() + self.rng.uniform(0.0, 2.5)
                _wait(lambda: time.monotonic() >= deadline, run, 5)
                if not run.running():
                    a.problems.append(f"exited before the kill (exit {run.proc.returncode})")
                    return
            else:  # the writer killed itself: the driver may have exited on the dead worker already
                torn = _wait(lambda: _write_unfinished(self.ckpt) and any(_state(p) in "XZ" for p in pids),
                             run, 120, poll_s=0.01)
                if not torn:
                    a.problems.append(f"the writer never died inside a write ({a.fault_at}; exit "
                                      f"{run.proc.returncode})")
            _kill_now(run, pids)
            a.during_write = _write_unfinished(self.ckpt)
        elif a.fault.startswith("engine-hang"):
            self.engine_hang(a, run)
        elif a.fault.startswith("engine"):
            self.engine_fault(a, run)
        elif a.fault == "disk":
            _finish(run, ATTEMPT_TIMEOUT_S)
            a.message = _failure(run)
            pointer = (self.ckpt / lora_only.LATEST).read_text().strip() if (self.ckpt / "latest").exists() else None
            want = lora_only.step_dir_name(a.expected_step) if a.expected_step is not None else None
            if run.proc.returncode == 0 or "CheckpointWriteError" not in a.message or "ENOSPC" not in a.message:
                a.problems.append(f"a full disk did not fail the attempt with ENOSPC named: {a.message!r}")
            if pointer != want:
                a.problems.append(f"latest is {pointer} after the failed write, was {want}")
        elif a.fault in ("none", "disk-not-run"):
            _finish(run, ATTEMPT_TIMEOUT_S)

    def engine_fault(self, a: Attempt, run: TrainRun) -> None:
        """Wait for the engine to die (it kills itself inside the call), then for the trainer to go Failed."""
        if not _wait(lambda: _engine_pid(run) is not None, run, ATTEMPT_TIMEOUT_S):
            a.problems.append("no engine process appeared")
            return
        pid = _engine_pid(run)
        _wait(lambda: _state(pid) in ("X", "Z"), run, ATTEMPT_TIMEOUT_S, poll_s=0.01)
        died = time.monotonic()
        failed = _wait(lambda: (s := run.poll()) is not None and s.get("phase") == "Failed", run, NOTICE_BOUND_S, 0.1)
        a.notice_s = round(time.monotonic() - died, 2)
        _finish(run, 60)
        a.message = _failure(run)
        if not failed and run.proc.returncode is None:
            a.problems.append(f"still running {NOTICE_BOUND_S:.0f}s after its engine died (a hang)")
        if "EngineLost" not in a.message or "SIGKILL" not in a.message:
            a.problems.append(f"the failure does not say the engine died: {a.message[-600:]!r}")

    def hang_at(self, fault: str) -> str:
        """Where and how the engine hangs: the two hows (SIGSTOP, a wedged event loop) in turn per kind; a sync hang
        alternates the HTTP path (the attempt's first push) with a fast-path push."""
        turn = sum(a.fault == fault for a in self.attempts[:-1])
        how = ("stop", "wedge")[turn % 2]
        if fault == "engine-hang-generate":
            return f"/generate:{self.rng.randint(2, 4)}:{how}"
        how = ("wedge", "stop")[turn % 2]
        if turn % 2 == 0:
            return f"/update_weights_from_distributed:1:{how}"
        return f"/kora/fast_sync/push:{self.rng.randint(2, 4)}:{how}"

    def engine_hang(self, a: Attempt, run: TrainRun) -> None:
        """Wait for the engine's hang mark in its log, then for the trainer to go Failed, naming the hung engine."""
        log = run.run_dir / "logs" / "engine-0.log"
        hung = _wait(lambda: log.is_file() and HANG_MARK in log.read_text(errors="replace"), run, ATTEMPT_TIMEOUT_S,
                     poll_s=0.01)
        if not hung:
            a.problems.append(f"the engine never hung ({a.fault_at}; exit {run.proc.returncode})")
            _finish(run, 60)
            return
        t0 = time.monotonic()
        bound = HANG_S + NOTICE_SLACK_S
        failed = _wait(lambda: (s := run.poll()) is not None and s.get("phase") == "Failed", run, 2 * bound, 0.1)
        a.notice_s = round(time.monotonic() - t0, 2)
        _finish(run, 60)
        a.message = _failure(run)
        if not failed and run.proc.returncode is None:
            a.problems.append(f"still running {2 * bound:.0f}s after its engine hung (a hang)")
        elif a.notice_s > bound:
            a.problems.append(f"noticed {a.notice_s} s after the hang, past HANG_S {HANG_S} + {NOTICE_SLACK_S:g} s")
        if "EngineLost" not in a.message or " hung: " not in a.message:
            a.problems.append(f"the failure does not say the engine hung: {a.message[-600:]!r}")

    def shrink_disk(self) -> str | None:
        """checkpoint.path's tmpfs cut to what it holds plus half a checkpoint: the next write cannot fit. The
        kernel's own count of used blocks (statvfs), not the files' sizes: tmpfs refuses a size below it."""
        st = os.statvfs(self.ckpt)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        newest, _ = disk_state(self.ckpt)
        one = sum(f.stat().st_size for f in newest.iterdir()) if newest else 1 << 20
        size = used + one // 2
        try:
            resize_tmpfs(self.ckpt, f"{-(-size // 4096) * 4}k")  # whole pages, in KiB
        except RuntimeError as e:
            files = sum(f.stat().st_size for f in self.ckpt.rglob("*") if f.is_file())
            return f"could not shrink the tmpfs ({used} B used by statvfs, {files} B in files): {e}"
        return None

    def check_steps(self, a: Attempt) -> None:
        got = {e["step"]: (e["loss"], e["reward_mean"]) for e in _events(self.work / f"attempt-{a.index:02d}")}
        for step, pair in sorted(got.items()):
            if self.ref_steps.get(step) != pair:
                a.problems.append(f"step {step}: loss/reward {pair} differs from the uninterrupted run's "
                                  f"{self.ref_steps.get(step)}")

    def check_resumed_adapters(self) -> None:
        for a in self.attempts:
            got = self.resumed_adapters.get(a.index)
            if got is None or a.resumed_step is None:
                continue
            want = _adapter(self.ref_ckpt / lora_only.step_dir_name(a.resumed_step))
            if want.keys() != got.keys() or not all(torch.equal(want[k], got[k]) for k in want):
                a.problems.append(f"the checkpoint of step {a.resumed_step} it loaded differs from the "
                                  "uninterrupted run's")


def _state(pid: int | None) -> str:
    """A process's state letter (Z: a zombie, dead), X when it is gone."""
    if pid is None:
        return "X"
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _step_of(path: Path | None) -> int | None:
    return int(path.name.split("_")[1]) if path is not None else None


def _events(work: Path) -> list[dict[str, Any]]:
    from kora_trainer.recorder import read_events

    return [e for e in read_events(work / "run") if e["event"] == "step"]


def _finish(run: TrainRun, timeout_s: float) -> None:
    """Bounded wait for the run to exit, polling its control plane meanwhile; killed on timeout."""
    deadline = time.monotonic() + timeout_s
    while run.running() and time.monotonic() < deadline:
        run.poll()
        time.sleep(0.2)
    if run.running():
        run.kill()


def _failure(run: TrainRun) -> str:
    """The failure the run published on /status (its last Failed message), else its output's tail."""
    failed = [s.get("message") or "" for s in run.seen if s.get("phase") == "Failed"]
    return failed[-1] if failed else run.output[-1500:]


def _wall(run: TrainRun) -> float:
    summary = [e for e in run.events("summary")]
    return float(summary[0]["wall_s"]) if summary and "wall_s" in summary[0] else 0.0
