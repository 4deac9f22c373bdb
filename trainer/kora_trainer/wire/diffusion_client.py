"""The trainer's side of the reference diffusion engine: rollouts over `POST /rollout/generate`, and the IPC-merge
sync over `POST /update_weights_from_tensor` (buckets of whole A/B pairs, `weight_update_mode="lora_merge"`).

Seeds: prompt k of a step asks for its G outputs with seed = the local rollout's stream of its first sample
(policy.generators), and the engine draws output i from seed + i, so the engine's samples are the ones the trainer
would have drawn itself.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import requests
import torch

from kora_trainer.algorithm import flow_grpo
from kora_trainer.lora.model import adapter_tensors, fold_targets
from kora_trainer.wire import flat_bucket
from kora_trainer.wire.diffusion import trajectory_from_responses
from kora_trainer.wire.diffusion_lora import LORA_MERGE, layer_groups, pack_pair_buckets, sync_log_line
from kora_trainer.wire.protocol import FLAT
from kora_trainer.wire.serialize import serialize_payload


class Prompted(Protocol):
    """What the client reads of the model it rolls out for: its prompts by index (toys/diffusion.py's DiffusionToy)."""

    @property
    def prompts(self) -> list[str]: ...


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> requests.Response:
    resp = requests.post(url, data=json.dumps(body), timeout=timeout)
    if resp.status_code != 200:
        raise RuntimeError(f"{url} answered {resp.status_code}: {resp.text[:500]}")
    return resp


class EngineRollout:
    """A train_loop.RolloutFn that asks the engine: one request per prompt, its G outputs adjacent."""

    def __init__(self, url: str, seed: int, num_inference_steps: int, noise_level: float, guidance_scale: float = 1.0):
        self.url, self.seed = url.rstrip("/"), seed
        self.steps, self.noise_level, self.guidance = num_inference_steps, noise_level, guidance_scale

    def __call__(self, toy: Prompted, ids: torch.Tensor, step: int) -> flow_grpo.Trajectory:
        prompts, counts = torch.unique_consecutive(ids, return_counts=True)
        trajs, first = [], 0
        for p, n in zip(prompts.tolist(), counts.tolist(), strict=True):
            body = {"prompt": toy.prompts[p], "seed": self.seed * 1_000_003 + step * 10_007 + first,
                    "num_inference_steps": self.steps, "num_outputs_per_prompt": n,
                    "rollout_noise_level": self.noise_level, "rollout_return_dit_trajectory": True,
                    "guidance_scale": self.guidance}
            trajs.append(trajectory_from_responses(msgpack.unpackb(_post(f"{self.url}/rollout/generate", body).content),
                                                   self.noise_level))
            first += n
        return flow_grpo.Trajectory(latents=torch.cat([t.latents for t in trajs]),
                                    log_probs=torch.cat([t.log_probs for t in trajs]), timesteps=trajs[0].timesteps,
                                    sigmas=trajs[0].sigmas, noise_level=self.noise_level)


@dataclass(frozen=True)
class Pushed:
    """One sync: what went to the engine (bytes of the tensors handed over), in how many calls, how long it took."""

    bytes: int
    buckets: int
    ms: float
    what: str  # lora_pairs | folded
    log: str | None = None  # a line for the job's log (the seed's first-sync line), printed by the driver


class LoraMergeSync:
    """EngineMerge (the seed's IPC merge): push the adapter's A/B pairs in buckets of whole pairs; the engine folds
    them into its pristine base. The first two syncs carry the seed's log line (`Pushed.log`: the driver prints it,
    wherever the pushing rank runs)."""

    def __init__(self, url: str, lora_rank: int, lora_alpha: float, buffer_bytes: int, module: str = "transformer"):
        self.url, self.rank, self.alpha = url.rstrip("/"), lora_rank, lora_alpha
        self.buffer_bytes, self.module, self.version = buffer_bytes, module, 0
        self.lines: list[str] = []

    def __call__(self, model: torch.nn.Module) -> Pushed:
        t0 = time.perf_counter()
        groups, unmapped = layer_groups(adapter_tensors(model))
        if unmapped:
            raise ValueError(f"adapter tensors with no engine name: {unmapped[:3]}")
        buckets = pack_pair_buckets(groups, self.buffer_bytes)
        for bucket in buckets:
            _push_flat(self.url, [t for g in bucket for t in g.named()], self.module,
                       {"weight_update_mode": LORA_MERGE, "lora_alpha": self.alpha, "lora_rank": self.rank})
        self.version += 1
        line = sync_log_line(self.version, self.module, buckets, len(unmapped))
        self.lines.append(line)
        ms = (time.perf_counter() - t0) * 1000
        return Pushed(sum(g.nbytes for g in groups), len(buckets), ms, "lora_pairs",
                      line if self.version <= 2 else None)


class FoldedSync:
    """Merge (the seed's train-side merge): fold each adapted weight, W + (alpha/r) B A in fp32 rounded once, and
    push those weights under the transformer's own names in buckets of at most `buffer_bytes` (a weight larger
    than that goes alone). The engine takes them as full weights (`weight_update_mode` null); the weights no
    adapter touches never change, so they are not sent."""

    def __init__(self, url: str, buffer_bytes: int, module: str = "transformer"):
        self.url, self.buffer_bytes, self.module = url.rstrip("/"), buffer_bytes, module

    def __call__(self, model: torch.nn.Module) -> Pushed:
        t0 = time.perf_counter()
        total, calls, size = 0, 0, 0
        bucket: list[tuple[str, torch.Tensor]] = []
        for name, m in fold_targets(model).items():
            t = m.folded_weight()
            if bucket and size + t.numel() * t.element_size() > self.buffer_bytes:
                self._push(bucket)
                calls, bucket, size = calls + 1, [], 0
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            total += t.numel() * t.element_size()
        if bucket:
            self._push(bucket)
            calls += 1
        return Pushed(total, calls, (time.perf_counter() - t0) * 1000, "folded")

    def _push(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        _push_flat(self.url, bucket, self.module, {"weight_update_mode": None})


def _push_flat(url: str, named: list[tuple[str, torch.Tensor]], module: str, fields: dict[str, Any]) -> None:
    """One `/update_weights_from_tensor` call carrying `named` as ONE flattened bucket (wire/flat_bucket.py): on a
    GPU the engine opens one CUDA IPC handle per call, not one per tensor. `bucket` (the flat copy) lives until the
    engine has answered: the engine reads the trainer's memory through the handle."""
    bucket = flat_bucket.flatten(named)
    _post(f"{url}/update_weights_from_tensor", {"serialized_named_tensors": [serialize_payload(bucket)],
                                                "load_format": FLAT, "target_modules": [module], **fields})
