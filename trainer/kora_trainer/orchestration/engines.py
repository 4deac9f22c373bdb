"""Rollout engine processes: started from the launcher's command line, stopped by pid, never orphaned.

`sglang_launcher.engine_command` builds the argv (a real `sglang.launch_server`, or kora's reference
`reference_engine`); this module runs it, waits (bounded) for `/health`, and stops it. The child gets
PR_SET_PDEATHSIG, so if the process that started it (a Ray worker) dies, the engine dies with it
instead of holding a port and CPU forever.

An engine binds the `host` it is given and its URL names it: 127.0.0.1 by default, the node's address
(one the other nodes reach) when the caller has a job spanning nodes. Its admin key (`admin_api_key`,
wire/engine_auth.py) is then what keeps the weight and adapter routes to the trainer alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kora_trainer.config import TrainerConfig
from kora_trainer.orchestration.sglang_launcher import engine_command
from kora_trainer.wire.engine_auth import KEY_ENVS
from kora_trainer.wire.engine_client import EngineClient
from kora_trainer.wire.ports import free_port

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec. The signal fires when the forking THREAD exits, so start
    engines from a long-lived thread (a Ray actor's main thread, the driver's). Off Linux: stop() only."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _write_private(path: Path, text: str) -> None:
    """A new file only its owner can read (O_EXCL: never through a file or link someone else made)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


@dataclass
class EngineProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @classmethod
    def start(cls, cfg: TrainerConfig, log_dir: Path, threads: int | None = None, index: int = 0,
              timeout_s: float = 180.0, host: str = "127.0.0.1", admin_api_key: str | None = None,
              api_key: str | None = None) -> EngineProcess:
        """Start engine `index` of the job bound to `host` (its URL uses it): 127.0.0.1 unless the caller
        gives the node's address other nodes reach. The keys reach it by environment (reference engine) or
        a private file (SGLang), never argv: sglang_launcher.py says how."""
        port = free_port(host)
        secrets_dir = tempfile.mkdtemp(prefix="kora-engine-keys-")  # 0700: SGLang's key file, if any
        kwargs: dict[str, object] = ({"num_threads": threads} if cfg.rollout.engine == "hf"
                                     else {"secrets_dir": secrets_dir})
        try:
            launch = engine_command(cfg, port, host, api_key=api_key, admin_api_key=admin_api_key, **kwargs)
            for path, text in launch.secret_files.items():
                _write_private(Path(path), text)
            engine = cls._spawn(launch.argv, launch.url, launch.env, log_dir, index, threads)
            try:
                engine.wait_ready(timeout_s)
            except BaseException:
                engine.stop()
                raise
        finally:
            shutil.rmtree(secrets_dir, ignore_errors=True)  # read at startup: the key stays in memory only
        return engine

    @classmethod
    def launch(cls, argv: list[str], url: str, log_dir: Path, threads: int | None = None,
               timeout_s: float = 180.0) -> EngineProcess:
        """Run an engine command that needs no keys (the reference diffusion engine) and wait for its /health."""
        engine = cls._spawn(argv, url, {}, log_dir, 0, threads)
        try:
            engine.wait_ready(timeout_s)
        except BaseException:
            engine.stop()
            raise
        return engine

    @classmethod
    def _spawn(cls, argv: list[str], url: str, launch_env: dict[str, str], log_dir: Path, index: int,
               threads: int | None) -> EngineProcess:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"engine-{index}.log"
        # keys only from this launch: not a stray KORA_ENGINE_*_KEY this process happens to carry
        env = {k: v for k, v in os.environ.items() if k not in KEY_ENVS}
        env.update({**launch_env, "TOKENIZERS_PARALLELISM": "false"})
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=_die_with_parent)
        return cls(proc, url, log_path)

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
        self.proc.send_signal(signal.SIGCONT)  # a stopped (SIGSTOPped) engine acts on SIGTERM once continued
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)
