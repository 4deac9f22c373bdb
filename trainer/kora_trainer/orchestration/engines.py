"""Rollout engine processes: started from the launcher's command line, stopped by pid, never orphaned.

`sglang_launcher.engine_command` builds the argv (a real `sglang.launch_server`, or kora's reference
`reference_engine`); this module runs it, waits (bounded) for `/health`, and stops it. The child gets
PR_SET_PDEATHSIG, so if the process that started it (a Ray worker) dies, the engine dies with it
instead of holding a port and CPU forever.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kora_trainer.config import TrainerConfig
from kora_trainer.orchestration.sglang_launcher import engine_command
from kora_trainer.wire.engine_client import EngineClient
from kora_trainer.wire.group import free_port

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec. The signal fires when the forking THREAD exits, so start
    engines from a long-lived thread (a Ray actor's main thread, the driver's). Off Linux: stop() only."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class EngineProcess:
    proc: subprocess.Popen  # type: ignore[type-arg]
    url: str
    log_path: Path

    @classmethod
    def start(cls, cfg: TrainerConfig, log_dir: Path, threads: int | None = None, index: int = 0,
              timeout_s: float = 180.0) -> EngineProcess:
        port = free_port()
        kwargs = {"num_threads": threads} if cfg.rollout.engine == "hf" else {}
        launch = engine_command(cfg, port, "127.0.0.1", **kwargs)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"engine-{index}.log"
        env = {**os.environ, **launch.env, "TOKENIZERS_PARALLELISM": "false"}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(launch.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=_die_with_parent)
        engine = cls(proc, launch.url, log_path)
        try:
            engine.wait_ready(timeout_s)
        except BaseException:
            engine.stop()
            raise
        return engine

    def wait_ready(self, timeout_s: float) -> None:
        with EngineClient(self.url) as client:
            try:
                client.wait_healthy(timeout_s=timeout_s)
            except TimeoutError:
                code = self.proc.poll()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"engine at {self.url} not healthy after {timeout_s:.0f}s "
                                   f"(exit code {code}); log tail:\n{tail}") from None

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)
