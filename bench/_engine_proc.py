"""The sync benches' engine process (bench/gpu_sync.py, bench/gpu_sync_colocated.py): kora's reference engine
(`kora_engine.lm.server`: EngineModel + the HTTP routes) over a random HF model built from a config directory in
the engine process (no checkpoint is read), and the pipe the bench drives it through.

Each bench keeps its own command handlers (what the engine does per message); this module holds what they share:
bringing the engine up (`start_reference_engine`), the engine-side receive/dispatch loop (`serve_commands`),
forwarding a failure to the bench (`guarded`), and the bench's handle on the process (`EngineProc`).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch


def start_reference_engine(model_dir: str, device: torch.device) -> tuple[Any, Any, str, float]:
    """(EngineModel, HFEngineServer, url, seconds to build the model): a random bf16 HF model from
    `model_dir`'s config on `device`, served over HTTP on a free localhost port from a daemon thread."""
    import transformers
    from aiohttp import web

    from kora_engine.lm.model import EngineModel
    from kora_engine.lm.server import HFEngineServer
    from kora_trainer.wire.ports import free_port

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    t0 = time.perf_counter()
    with torch.device(device):  # random init; the trainer's pushes replace the weights
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    build_s = time.perf_counter() - t0
    transformers.AutoModelForCausalLM.from_pretrained = lambda *a, **k: model  # EngineModel takes this one
    engine = EngineModel(model_dir, "cuda" if device.type == "cuda" else "cpu", "bfloat16")
    server = HFEngineServer(engine)
    port = free_port()
    loop = asyncio.new_event_loop()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(server.app(), access_log=None)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    return engine, server, f"http://127.0.0.1:{port}", build_s


Handler = Callable[[dict[str, Any]], dict[str, Any] | None]


def serve_commands(conn: Any, handlers: Mapping[str, Handler]) -> None:
    """The engine's command loop: each (cmd, kwargs) from the bench runs handlers[cmd](kwargs) and is answered
    ("done", what it returned, {} for None); "stop" is answered and ends the loop. An unknown command raises
    (`guarded` sends it to the bench)."""
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            conn.send(("done", {}))
            return
        info = handlers[cmd](arg)
        conn.send(("done", {} if info is None else info))


def guarded(loop: Callable[[Any, dict[str, Any]], None], conn: Any, opts: dict[str, Any]) -> None:
    """Run an engine's command loop; a failure goes to the bench as ("error", traceback) before it raises."""
    try:
        loop(conn, opts)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


class EngineProc:
    """The engine process (spawned: `target(conn, opts)`, a module-level function) and its pipe. Messages are
    (cmd, kwargs) one way and (kind, info) back: "ready" once, "done" per command, "error" on a failure."""

    def __init__(self, target: Callable[[Any, dict[str, Any]], None], opts: dict[str, Any]):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, opts), daemon=True)
        self.proc.start()
        self.info: dict[str, Any] = {}

    def wait(self, what: str = "done", timeout: float = 600) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"engine died (exit {self.proc.exitcode}) waiting for {what}")
            if time.monotonic() > end:
                raise TimeoutError(f"engine did not answer {what} within {timeout}s")
        kind, info = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"engine failed:\n{info}")
        assert kind == what, (kind, what)
        return info

    def ready(self, timeout: float = 900) -> dict[str, Any]:
        self.info = self.wait("ready", timeout=timeout)
        return self.info

    def send(self, cmd: str, **arg: Any) -> None:
        self.conn.send((cmd, arg))

    def call(self, cmd: str, timeout: float = 600, **arg: Any) -> dict[str, Any]:
        self.send(cmd, **arg)
        return self.wait(timeout=timeout)

    def fast_call(self, cmd: str, **arg: Any) -> dict[str, Any]:
        """The per-push control message: blocking recv, no polling loop."""
        self.conn.send((cmd, arg))
        kind, info = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"engine failed:\n{info}")
        return info

    def stop(self, timeout: float = 30) -> None:
        try:
            if self.proc.is_alive():
                self.call("stop", timeout=timeout)
        finally:
            self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.terminate()
