"""megatron-core's real layers, schedules and process groups on the CPU over gloo, for tests on a machine without a GPU.

A TEST DOUBLE FOR CUDA (which cannot run here), nothing else: megatron-core places a few tensors on "cuda" by name
(the pipeline schedules' token counter, the p2p shape exchange, the default causal mask, `.cuda()` on the model),
seeds CUDA RNG streams and synchronises the CUDA device. `install()` sends those placements to the CPU, turns the
CUDA RNG tracker's fork into a no-op (dropout is 0 in every megatron config kora builds; LoRA dropout draws from
torch's own generator) and the device synchronise into one. Every layer, every collective (gloo), the schedules
and parallel_state run as they are. The megatron-core that installs on Python 3.11 is 0.16.1 (the test group pins
it); the GPU machines run 0.19.2, where the GPU tests cover the CUDA paths this replaces.
"""

from __future__ import annotations

import contextlib
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
        return func(*args, **kwargs)


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
    tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: None
    mc_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # type: ignore[assignment,method-assign]
    _CudaOnCpu().__enter__()
    _installed = True


def run_ranks(module: str, func: str, world: int, *args: Any, timeout_s: float = 240.0) -> None:
    """`module.func(rank, world, *args)` in `world` fresh processes (one per rank), each with `install()` done;
    returns once all exited 0, else raises with the failing ranks' output. Plain subprocesses, waited on by pid:
    the in-memory weight hand-over starts torch's shared-memory manager, a daemon that inherits its starter's
    pipes, so a launcher that waits for a pipe to close (multiprocessing, torch.multiprocessing.spawn) never
    returns."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    code = ("import json, sys\nimport megatron_cpu\nmegatron_cpu.install()\n"
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
            except subprocess.TimeoutExpired:
                for p, _ in procs:
                    p.kill()
                rc = "timed out"
            log.close()
            if rc != 0:
                failed.append(f"rank {rank} ({rc}):\n{(Path(logs) / f'rank{rank}.log').read_text()[-4000:]}")
        if failed:
            raise RuntimeError("\n".join(failed))
