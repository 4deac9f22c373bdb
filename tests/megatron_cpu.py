"""megatron-core's real layers, schedules and process groups on the CPU over gloo, for tests on a machine without a GPU.

A TEST DOUBLE FOR CUDA (which cannot run here), nothing else: megatron-core places a few tensors on "cuda" by name
(the pipeline schedules' token counter, the p2p shape exchange, the default causal mask, `.cuda()` on the model),
seeds CUDA RNG streams, synchronises the CUDA device and, in the MoE token dispatcher, copies routing counts to the
host on a side stream (as numpy arrays: the all-to-all's split sizes; a tensor already on the host stays a
tensor, which the all-to-all refuses). `install()` sends those placements to the CPU, makes that copy's numpy
arrays from host tensors too, turns the CUDA RNG tracker's fork into a no-op
(dropout is 0 in every megatron config kora builds; LoRA dropout draws from torch's own generator), and the device
synchronise, streams and events into ones that have nothing to wait for (the CPU runs every op in order). Every
layer, every collective (gloo), the schedules and parallel_state run as they are.

The megatron-core that installs on Python 3.11 is 0.16.1 (the test group pins it); the GPU machines run 0.19.2,
where the GPU tests cover the CUDA paths this replaces. One fix that is not CUDA's: 0.16.1's router gating refers to
TransformerEngine's GEMM by a name it never binds without TransformerEngine (a NameError); `install()` binds it to
None, as 0.19.2 does.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_installed = False


class _CudaOnCpu(TorchFunctionMode):
    """Factory calls asking for a CUDA device get the CPU; `Tensor.cuda()` leaves a tensor where it is."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        return func(*args, **kwargs)


class _Event:
    """A CUDA event on the CPU: every op before it has already run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """A CUDA stream on the CPU: ops run in program order, so there is never anything to wait for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT = _Stream()


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's `maybe_move_tensor_to_cpu` (the MoE dispatcher's D2H copy) for tensors already on the host: the
    numpy array the GPU path returns where `as_numpy`, else the tensor."""
    return tensor.numpy() if as_numpy and isinstance(tensor, torch.Tensor) else tensor


def install() -> None:
    """Make this process run megatron-core on the CPU (idempotent; call before building a model). Refuses to act
    where a GPU is present: there the real CUDA paths must run."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu.install() is for machines without a GPU; on a GPU run megatron as is")
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mc_random

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.Stream = _Stream  # type: ignore[assignment,misc]
    torch.cuda.Event = _Event  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _CURRENT  # type: ignore[assignment,return-value]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: None
    mc_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # type: ignore[assignment,method-assign]
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _to_host  # type: ignore[attr-defined]
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    _CudaOnCpu().__enter__()
    _installed = True


def _accept_megatron_here(select: Any) -> None:
    """install(), and the trainer's backend choice told that megatron can run: its check for a GPU is the one
    thing of CUDA this double replaces that the trainer asks itself (an explicit `backend: megatron` only; auto
    keeps choosing as it would here)."""
    install()
    from kora_trainer.config.trainer import Backend

    choose = select.resolve_backend

    def resolve_backend(cfg: Any, *, cuda: bool, megatron: bool, **kw: Any) -> Any:
        if cfg.backend is Backend.MEGATRON:
            cuda = megatron = True
        return choose(cfg, cuda=cuda, megatron=megatron, **kw)

    select.resolve_backend = resolve_backend


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` right after `name` is first imported (and leaves every other import alone)."""

    def __init__(self, name: str, then: Callable[[Any], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the lookup below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self.then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_in_trainer() -> None:
    """For a `python -m kora_trainer.train` a test starts (tests/megatron_cpu_site/sitecustomize.py): where this
    process imports the trainer's backend choice — a rank actor, when it builds its backend — run megatron-core on
    the CPU (`install`) and accept `backend: megatron` without a GPU. Ray's own processes and the engines never
    import it and stay as they are."""
    sys.meta_path.insert(0, _AfterImport("kora_trainer.backends.select", _accept_megatron_here))


def run_ranks(module: str, func: str, world: int, *args: Any, timeout_s: float = 150.0) -> None:
    """`module.func(rank, world, *args)` in `world` fresh processes (one per rank), each with `install()` done;
    returns once all exited 0, else raises with the failing ranks' output (a rank still running after `timeout_s`
    writes its threads' stacks there first). Plain subprocesses, waited on by pid:
    the in-memory weight hand-over starts torch's shared-memory manager, a daemon that inherits its starter's
    pipes, so a launcher that waits for a pipe to close (multiprocessing, torch.multiprocessing.spawn) never
    returns."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    code = ("import faulthandler, json, signal, sys\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"
            "import megatron_cpu\nmegatron_cpu.install()\n"
            f"from {module} import {func}\n{func}(int(sys.argv[1]), {world}, *json.loads(sys.argv[2]))\n")
    paths = [str(tests), str(tests / "unit"), str(tests.parent / "hack"), str(tests.parent / "trainer")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as logs:
        procs = []
        for rank in range(world):
            log = open(Path(logs) / f"rank{rank}.log", "wb")  # noqa: SIM115 (closed below)
            procs.append((subprocess.Popen([sys.executable, "-c", code, str(rank), json.dumps(list(args))],
                                           stdout=log, stderr=subprocess.STDOUT, env=env), log))
        failed = []
        for rank, (proc, log) in enumerate(procs):
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:  # every rank's stacks into its log, then stop them all
                for p, _ in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGUSR1)
                for p, _ in procs:
                    try:
                        p.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
                rc = "timed out"
            log.close()
            if rc != 0:
                failed.append(f"rank {rank} ({rc}):\n{(Path(logs) / f'rank{rank}.log').read_text()[-4000:]}")
        if failed:
            raise RuntimeError("\n".join(failed))
