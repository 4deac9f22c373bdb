"""The weight-update process group the trainer (rank 0) and the engines (ranks 1..) share.

It is a group of its own, not torch's default group: the trainer may already have a default group
for its data-parallel ranks, and an engine has its own tensor-parallel group. Both sides call
`init_weight_update_group` with the same address/port/world size — the trainer directly, each
engine when it receives `POST /init_weights_update_group` (SGLang's route and fields; the engine's
rank is `rank_offset + tp_rank`). gloo on CPU, NCCL on GPU.

`WeightUpdateGroup.wrap` puts the same face on a process group made elsewhere (megatron's tensor-parallel
group: the delta-skip's MAX and the fast path's shard gathers run over it).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypedDict

import torch
import torch.distributed as dist

DEFAULT_GROUP_NAME = "weight_update_group"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _ListenArgs(TypedDict, total=False):
    master_listen_fd: int


def _listen_on(host: str, port: int) -> _ListenArgs:
    """TCPStore arguments for a server that listens on `host` (IPv4: loopback, or the node's address when the
    group spans nodes) only. Left to itself the store listens on
    every interface (IPv6 `::`), and each loopback peer then shows up as ::ffff:127.0.0.1, whose reverse lookup
    for torch's log lines misses /etc/hosts and goes to the DNS server."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return {"master_listen_fd": sock.detach()}  # the store owns (and closes) the descriptor from here


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (a UDP socket's connect sends nothing): the address a
    group member on another node reaches us at. Loopback for a loopback host."""
    if is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


@dataclass
class WeightUpdateGroup:
    """The group plus the TCP store it was made from (kept alive as long as the group)."""

    pg: dist.ProcessGroup
    store: dist.Store | None  # None: a wrapped group whose store belongs to whoever made it
    rank: int
    world_size: int
    backend: str

    @classmethod
    def wrap(cls, pg: dist.ProcessGroup, backend: str | None = None) -> WeightUpdateGroup:
        """An existing process group (e.g. megatron's tensor-parallel group) with this class's methods; ranks are
        the group's own (0 .. size-1), not global ranks."""
        return cls(pg, None, pg.rank(), pg.size(), str(backend or dist.get_backend(pg)))

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def allreduce_max(self, tensor: torch.Tensor) -> None:
        self._allreduce(tensor, dist.ReduceOp.MAX)

    def allreduce_sum(self, tensor: torch.Tensor) -> None:
        self._allreduce(tensor, dist.ReduceOp.SUM)

    def _allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.pg.allreduce([tensor], opts).wait()

    def gather(self, tensor: torch.Tensor, outs: list[torch.Tensor] | None, dst: int = 0) -> None:
        """Rank `dst` receives every rank's `tensor` into `outs` (rank order, contiguous, same size and dtype);
        the other ranks pass None. Every rank calls it."""
        opts = dist.GatherOptions()
        opts.rootRank = dst
        if self.rank == dst and (outs is None or len(outs) != self.world_size):
            raise ValueError(f"gather: rank {dst} needs {self.world_size} output tensors")
        self.pg.gather([outs] if self.rank == dst and outs is not None else [], [tensor], opts).wait()


def _store(master_address: str, master_port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The group's TCP store: rank 0 serves it on `master_address` only, the others connect."""
    return dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                         **_listen_on(master_address, master_port) if rank == 0 else {})


def gloo_options(master_address: str, timeout: timedelta) -> Any:
    """gloo's default device resolves the machine's hostname (DNS where /etc/hosts lacks it) and binds its address:
    bind the address the master is reached from instead (loopback when all members are local)."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stub calls it Options
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(master_address))]
    return options


def init_default_group(master_address: str, master_port: int, rank: int, world_size: int,
                       timeout_s: float = 120.0) -> None:
    """torch's default process group (gloo) for a process of its own, e.g. a Ray actor per rank: what FSDP2's
    device mesh and torch.distributed.checkpoint's state dicts run over. Reached as the weight-update group is
    (the store and gloo bound to `master_address`'s side of the route only)."""
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=_store(master_address, master_port, rank, world_size, timeout),
                            rank=rank, world_size=world_size, timeout=timeout,
                            pg_options=gloo_options(master_address, timeout))


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> WeightUpdateGroup:
    """Join (rank 0: create) the group. Blocks until all `world_size` members have joined."""
    timeout = timedelta(seconds=timeout_s)
    store = _store(master_address, master_port, rank, world_size, timeout)
    prefixed = dist.PrefixStore(group_name, store)
    pg: dist.ProcessGroup
    if backend == "gloo":
        options = gloo_options(master_address, timeout)
        # a Backend has ProcessGroup's collectives (broadcast/allreduce/gather) at runtime; its stub lists none
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)  # type: ignore[assignment]
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)  # type: ignore[assignment]  # as above
    else:
        raise ValueError(f"backend {backend!r}: use gloo (CPU) or nccl (GPU)")
    group = WeightUpdateGroup(pg, store, rank, world_size, backend)
    # a first collective proves every member is in before anyone sends weights
    group.allreduce_max(torch.zeros(1, device=group.device))
    return group
