"""EngineMerge's gather on the engine (issue 17): a colocated push in one device context.

With one trainer rank the trainer's flat adapter is mapped into the engine once (the plan's `gather`: CUDA IPC
on GPU, shared memory on CPU), and a push is the engine's alone: the trainer synchronises its step and stores
one request; the engine gathers the adapter into ring slot k, taking the delta number against slot k-1 (what it
was last given) in the same pass (kernels/gather_delta.py), folds slot k, and — when the number is not above the
trainer's threshold — folds slot k-1 back in. Before this, the trainer's context gathered the slot and the
engine's fold waited on the trainer's IPC event: without MPS two processes' contexts time-slice the GPU, and the
hand-over from one to the other sat on every push's critical path.

On a GPU each slot's gather and the number's copy to pinned host memory are one captured CUDA graph, so a push's
host work is two graph replays (this and the fold) and a synchronise.
"""

from __future__ import annotations

from typing import Any

import torch

from kora_trainer.kernels.gather_delta import gather_max_delta
from kora_trainer.wire.fast_receive import AdapterRing
from kora_trainer.wire.serialize import deserialize_payload


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"gather.dtype {name!r} is not a torch dtype")
    return dtype


class SlotGather:
    """The trainer's flat adapter (mapped) gathered into ring slot k, with the number against slot k-1.

    `source` (the plan body's `gather`): `payload` (serialize_payload of [("flat", the flat adapter), ("starts",
    the runs' starts)]), `run` (elements per run), `numel` and `dtype` (the slot's elements, as
    `AdapterPack.view_of` lays them)."""

    def __init__(self, source: dict[str, Any], ring: AdapterRing, device: torch.device):
        named = dict(deserialize_payload(source["payload"]))
        self.flat, self.starts = named["flat"], named["starts"]
        self.run, numel, dtype = int(source["run"]), int(source["numel"]), _dtype(str(source["dtype"]))
        if device.type == "cuda" and device.index is None:  # the engine's "cuda": its current device
            device = torch.device("cuda", torch.cuda.current_device())
        for name, t in (("flat", self.flat), ("starts", self.starts)):
            if t.device != device:
                raise ValueError(f"gather.{name} is on {t.device}, the engine on {device}: the trainer beside it "
                                 f"maps the engine's device")
        need = numel * dtype.itemsize
        if any(buf.numel() < need for buf in ring.buffers):
            raise ValueError(f"gather: {numel} {dtype} elements do not fit a ring slot of {ring.buffers[0].numel()} B")
        self.views = [buf[:need].view(dtype) for buf in ring.buffers]
        self.number = torch.zeros(1, dtype=torch.float32, device=device)
        cuda = device.type == "cuda"
        self.host = torch.zeros(1, dtype=torch.float32, pin_memory=True) if cuda else self.number
        self.graphs: list[torch.cuda.CUDAGraph] = []
        if cuda:
            self._capture(device)

    def _launch(self, k: int) -> None:
        gather_max_delta(self.flat, self.starts, self.views[k - 1], self.number, self.views[k], self.run)

    def _capture(self, device: torch.device) -> None:
        """One graph per slot (the kernel compiled outside the capture, into slot 0: the plan fills every slot
        after this, `fill`)."""
        self._launch(0)
        torch.cuda.synchronize(device)
        pool = torch.cuda.graph_pool_handle()
        for k in range(len(self.views)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._launch(k)
                self.host.copy_(self.number, non_blocking=True)
            self.graphs.append(graph)
        torch.cuda.synchronize(device)

    def fill(self) -> None:
        """Every slot = the trainer's adapter now (at plan time: what the engine was last given, the HTTP push)."""
        for k in range(len(self.views)):
            self._launch(k)

    def enqueue(self, k: int) -> None:
        """Slot k gathered and its number against slot k-1, enqueued (read `delta()` after a synchronise)."""
        if self.graphs:
            self.graphs[k].replay()
        else:
            self._launch(k)

    def warm(self, k: int) -> None:
        """Slot k gathered once and synchronised, ahead of the request that names it (ARM in the words): the
        watcher's first launch after a step of sleep runs its host path cold, and a push's launch is on its critical
        path. The slot is scratch until that request gathers it again (the number is read only after a push's own
        gather), so this changes nothing the engine serves."""
        self.enqueue(k)
        if self.graphs:
            torch.cuda.synchronize(self.number.device)

    def delta(self) -> float:
        return float(self.host[0])
