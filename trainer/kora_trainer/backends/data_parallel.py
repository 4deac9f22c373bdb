"""Data parallelism over the trainer's ranks, for both backends (backends/grpo_step.py calls it).

Every DP rank holds the whole step's batch (one Ray object, read by each rank) and the same minibatch order (the
shuffle generator has the same seed and state on every rank), so the ranks agree on each minibatch; each rank
then computes the loss of its share of the minibatch's samples, normalised by the WHOLE minibatch's response
tokens, and the adapter gradients are summed over the DP group before clipping and the optimizer step. The sum
of the shares' gradients is the gradient of the whole minibatch, so a job at data N takes the same optimizer steps
as at data 1: the same losses and adapter up to the order of the floating-point sums. Only the adapter's
gradients travel (one flat buffer per step and minibatch): the base is frozen.

LoRA dropout draws from each rank's own torch RNG, so with lora.dropout > 0 the ranks' masks differ from a
one-rank run's (the equality above holds with dropout 0, the default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kora_trainer.wire.group import WeightUpdateGroup, init_weight_update_group

TRAINER_GROUP = "kora_trainer"


@dataclass(frozen=True)
class RankContext:
    """Where one trainer rank sits in the world and where the trainer's process group meets (rank 0's node
    address and a port free there)."""

    rank: int
    world: int
    master_address: str
    master_port: int

    def join(self, backend: str) -> WeightUpdateGroup | None:
        """The trainer's own process group (every rank; None for one rank), gloo on CPU, NCCL on GPU."""
        if self.world == 1:
            return None
        return init_weight_update_group(self.master_address, self.master_port, self.rank, self.world,
                                        TRAINER_GROUP, backend)

    def torch_env(self) -> dict[str, str]:
        """torch.distributed's env:// contract, for a backend that makes the default group (megatron's)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": "0",  # Ray: one visible GPU
                "MASTER_ADDR": self.master_address, "MASTER_PORT": str(self.master_port)}


@dataclass
class DataParallel:
    rank: int = 0
    size: int = 1
    group: WeightUpdateGroup | None = None  # None: one rank
    # expert parallelism (megatron): the experts' parameters (by id) are each held by the ranks of one expert-data-
    # parallel group and summed over it (their gradients already hold every token routed to them: megatron's
    # all-to-all brings them); None: no such group, or a group of one
    expert_group: WeightUpdateGroup | None = None
    expert_params: frozenset[int] = frozenset()
    # sequence parallelism (megatron at tensor > 1): the replicated LoRA factors that saw only this
    # rank's tokens (by id), their gradients summed over the tensor-parallel group as well
    sequence_group: WeightUpdateGroup | None = None
    sequence_params: frozenset[int] = frozenset()

    def share(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of a minibatch's sample indices (the first ranks take one more when
        the minibatch does not divide evenly)."""
        return idx if self.size == 1 else idx.tensor_split(self.size)[self.rank]

    def allreduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the parameters' gradients over the DP group (a rank whose share was empty contributes zeros), the
        experts' over their expert-data-parallel group, the sequence-parallel ones' over the TP group too."""
        if (self.group is None or self.size == 1) and self.expert_group is None and self.sequence_group is None:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        dense = [p for p in params if id(p) not in self.expert_params]
        experts = [p for p in params if id(p) in self.expert_params]
        if self.group is not None and self.size > 1:
            _sum_grads(self.group, dense)
        if self.expert_group is not None:
            _sum_grads(self.expert_group, experts)
        if self.sequence_group is not None:
            _sum_grads(self.sequence_group, [p for p in params if id(p) in self.sequence_params])

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the DP group (float64, one collective)."""
        if self.group is None or self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.group.device)
        self.group.allreduce_sum(t)
        return [float(v) for v in t.tolist()]

    def max(self, value: float) -> float:
        if self.group is None or self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.group.device)
        self.group.allreduce_max(t)
        return float(t.item())


def _sum_grads(group: WeightUpdateGroup, params: list[torch.nn.Parameter]) -> None:
    """Sum `params`' gradients over `group`: one flat buffer, one collective."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    group.allreduce_sum(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
