"""A step's rollouts as the actor consumes them, and their padded tensor layout.

The G samples of a prompt are adjacent (sample i belongs to group i // G), which is the order
SGLang returns `n > 1` samples in and what `grpo.group_advantages` expects.

Tensors are response-aligned: [B, R] where R is the longest response; column j is response token j.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kora_trainer.wire.vision import ImageInputs


@dataclass
class RolloutBatch:
    prompt_ids: list[list[int]]  # [B] prompt token ids (bos included)
    response_ids: list[list[int]]  # [B] generated token ids (eos included when generated)
    rollout_logprobs: list[list[float]]  # [B] the engine's log p of each generated token
    rewards: list[float]  # [B]
    group_size: int
    weight_versions: list[str | None] = field(default_factory=list)  # [B] what the engine served
    # [B] each sample's images as its prompt's forward takes them (a VL model), or [] (text-only: no images at all)
    images: list[ImageInputs | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def rows(self, lo: int, hi: int) -> RolloutBatch:
        """Samples lo..hi-1 (whole groups, when lo and hi are multiples of group_size)."""
        return RolloutBatch(self.prompt_ids[lo:hi], self.response_ids[lo:hi], self.rollout_logprobs[lo:hi],
                            self.rewards[lo:hi], self.group_size, self.weight_versions[lo:hi], self.images[lo:hi])

    @staticmethod
    def joined(parts: list[RolloutBatch]) -> RolloutBatch:
        """Batches of one group size, one after the other."""
        out = RolloutBatch([], [], [], [], parts[0].group_size)
        for b in parts:
            out.prompt_ids += b.prompt_ids
            out.response_ids += b.response_ids
            out.rollout_logprobs += b.rollout_logprobs
            out.rewards += b.rewards
            out.weight_versions += b.weight_versions
            out.images += b.images
        return out


@dataclass
class Padded:
    prompts: list[list[int]]  # [B]
    responses: list[list[int]]  # [B]
    response_ids: torch.Tensor  # [B, R] right-padded with pad_id
    response_mask: torch.Tensor  # [B, R] 1.0 on real response tokens
    rollout_logp: torch.Tensor  # [B, R] the engine's log-probs, 0 on padding
    images: list[ImageInputs | None] = field(default_factory=list)  # [B] or [] (see RolloutBatch.images)

    def select(self, idx: torch.Tensor) -> Padded:
        rows = idx.tolist()
        return Padded([self.prompts[i] for i in rows], [self.responses[i] for i in rows], self.response_ids[idx],
                      self.response_mask[idx], self.rollout_logp[idx],
                      [self.images[i] for i in rows] if self.images else [])


def pad(prompts: list[list[int]], responses: list[list[int]], rollout_logprobs: list[list[float]] | None = None,
        pad_id: int = 0, images: list[ImageInputs | None] | None = None) -> Padded:
    b = len(prompts)
    width = max(1, max(len(r) for r in responses))
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width))
    old = torch.zeros((b, width))
    for i, r in enumerate(responses):
        if not r:
            continue
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1.0
        if rollout_logprobs is not None:
            if len(rollout_logprobs[i]) != len(r):
                raise ValueError(f"sample {i}: {len(r)} response tokens but {len(rollout_logprobs[i])} log-probs")
            old[i, :len(r)] = torch.tensor(rollout_logprobs[i])
    return Padded(list(prompts), list(responses), ids, mask, old, list(images or []))
