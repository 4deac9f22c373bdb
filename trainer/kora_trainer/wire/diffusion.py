"""The diffusion engine's protocol, both halves: sglang-diffusion's request bodies (`RolloutRequest`,
`UpdateWeightsFromTensorRequest`), its tensor encoding, and the trainer's decoding of a rollout answer into the
`Trajectory` the re-score reads. The engine (kora_engine/diffusion/server.py) serves them, the trainer's client
(wire/diffusion_client.py) sends them; the LoRA push's payload (pair buckets, names, the fold) is
wire/diffusion_lora.py.

It matches sgl-project/sglang python/sglang/multimodal_gen/runtime/entrypoints/post_training/: the request and
response fields of io_struct.py @ 00e1106f4ab55cfb7dceeba2dfbc04b0cc40bb6f (`RolloutRequest`, `RolloutResponse`)
and the tensor encoding of utils.py @ 067e8f42c478f654f149497429caddd0b28d3490 (`{"__tensor__": true, "data":
base64 safetensors, "shape", "dtype"}`).
"""

from __future__ import annotations

import base64
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load, save

from kora_trainer.algorithm import flow_grpo


class RolloutRequest(BaseModel):
    """sglang-diffusion's RolloutRequest (the fields the toy can serve; unknown keys ignored, as FastAPI does)."""

    model_config = ConfigDict(extra="ignore")

    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    num_outputs_per_prompt: int | None = None
    guidance_scale: float | None = None
    rollout: bool = True
    rollout_sde_type: str = "sde"
    rollout_noise_level: float = 0.7
    rollout_log_prob_no_const: bool = False
    rollout_return_dit_trajectory: bool = False
    rollout_sde_step_indices: list[int] | None = None
    rollout_return_step_indices: list[int] | None = None


class UpdateWeightsFromTensorRequest(BaseModel):
    """sglang-diffusion's UpdateWeightFromTensorReqInput."""

    model_config = ConfigDict(extra="ignore")

    serialized_named_tensors: list[str]
    load_format: str | None = None
    target_modules: list[str] | None = None
    weight_update_mode: str | None = None
    lora_alpha: float | None = None
    lora_rank: int | None = None


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().contiguous().cpu()
    return {"__tensor__": True, "data": base64.b64encode(save({"t": t})).decode("ascii"), "shape": list(t.shape),
            "dtype": str(t.dtype)}


def decode_tensor(obj: dict[str, Any]) -> torch.Tensor:
    tensor: torch.Tensor = load(base64.b64decode(obj["data"]))["t"]
    return tensor


def trajectory_from_responses(responses: list[dict[str, Any]], noise_level: float) -> flow_grpo.Trajectory:
    """The trainer's side: a /rollout/generate answer (msgpack-decoded, rollout_return_dit_trajectory on) ->
    the Trajectory the re-score reads. timesteps drop the closing t = 0 entry: [T+1] -> [T]."""
    trajs = [r["dit_trajectory"] for r in responses]
    if any(t is None for t in trajs):
        raise ValueError("a response has no dit_trajectory: send rollout_return_dit_trajectory=true")
    timesteps = decode_tensor(trajs[0]["timesteps"])
    return flow_grpo.Trajectory(latents=torch.stack([decode_tensor(t["latents"]) for t in trajs]),
                                log_probs=torch.stack([decode_tensor(r["rollout_log_probs"]) for r in responses]),
                                timesteps=timesteps[:-1], sigmas=decode_tensor(trajs[0]["sigmas"]),
                                noise_level=noise_level)
