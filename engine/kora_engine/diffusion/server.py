"""A reference diffusion rollout engine for the toy: sglang-diffusion's rollout route, on CPU or a GPU, on 127.0.0.1.

`python -m kora_engine.diffusion.server --toy DIR --port P` serves
  GET  /health                       200 once the toy is loaded, at once even while a rollout or update runs
  POST /rollout/generate             a JSON `RolloutRequest` -> a msgpack list of `RolloutResponse`, one per output
  POST /update_weights_from_tensor   `serialized_named_tensors` (wire/serialize.py: same-host handles, one entry; the
                                     payload is unpickled, so the engine binds 127.0.0.1 and trusts its trainer),
                                     `load_format` (null, or "flattened_bucket": wire/flat_bucket.py),
                                     `target_modules` (["transformer"] or null),
                                     `weight_update_mode`: null = full weights by name, "lora_merge" = A/B pairs
                                     (`lora_alpha`, `lora_rank`) folded into the pristine base kept at load, fp32
                                     (stacked_fold.py beside this file: a few launches per shape group, not per layer)
                                     -> {"success", "message"}
It matches sgl-project/sglang python/sglang/multimodal_gen/runtime/entrypoints/post_training/: the request and
response fields of io_struct.py @ 00e1106f4ab55cfb7dceeba2dfbc04b0cc40bb6f (`RolloutRequest`, `RolloutResponse`),
the route and the per-sample slicing of rollout_api.py @ 078e5e2a5227bb6af1727574bb6212f0afb25250 (msgpack body,
`rollout_log_probs` [T], `dit_trajectory` {latents [T+1, C, H, W], timesteps, sigmas}), and the tensor encoding of
utils.py @ 067e8f42c478f654f149497429caddd0b28d3490 (`{"__tensor__": true, "data": base64 safetensors, "shape",
"dtype"}`); the request bodies and that encoding are kora_trainer/wire/diffusion.py, which the trainer's client
shares. The toy's prompt is its name in prompts.jsonl (`colour-03`); output i draws from its own generator
seeded `seed + i` (kora's rule: sglang's per-output seeding was not checked).
Refused with 400 and the field named, not silently ignored: another SDE type than "sde", `rollout_log_prob_no_const`,
a `negative_prompt` other than the empty one (the toy's unconditional embedding; `guidance_scale` > 1 guides every
step with it, v = v_uncond + g (v_cond - v_uncond)), a width/height other than the toy's, step filters.
The update request's fields are io_struct.py's `UpdateWeightFromTensorReqInput` (same commit); its answer's shape
is the LLM routes' {"success", "message"} (sglang-diffusion's own answer was not read). Not built yet:
`/get_weights_checksum`, the admin key, a weight_version.
On a GPU (`--device cuda`) a push's tensors arrive as CUDA IPC handles of the trainer's memory on the same GPU
(wire/serialize.py): the engine folds and copies from them on the device and synchronizes before it answers.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import torch
from aiohttp import web
from pydantic import ValidationError

from kora_engine.diffusion.stacked_fold import StackedFolds
from kora_engine.faults import ExitAt
from kora_trainer.algorithm import flow_grpo
from kora_trainer.toys.diffusion import DiffusionToy, load_diffusion_toy
from kora_trainer.toys.diffusion_policy import velocity_fn
from kora_trainer.wire import flat_bucket
from kora_trainer.wire.diffusion import RolloutRequest, UpdateWeightsFromTensorRequest, encode_tensor
from kora_trainer.wire.diffusion_lora import LORA_MERGE
from kora_trainer.wire.protocol import FLAT
from kora_trainer.wire.serialize import deserialize_named_tensors, deserialize_payload

MAX_OUTPUTS = 64
MAX_STEPS = 100


class ToyEngine:
    """The engine's state: the toy, and a pristine copy of every transformer weight taken at load (lora_merge folds
    from it every sync, so merges never accumulate)."""

    def __init__(self, toy: DiffusionToy):
        self.toy = toy
        self.params = dict(toy.transformer.named_parameters())
        self.pristine = {n: p.detach().clone() for n, p in self.params.items()}
        self.folds = StackedFolds(self.params, self.pristine)

    def update(self, req: UpdateWeightsFromTensorRequest) -> str:
        """Apply one update; ValueError (-> 400) names the field for what it cannot take. A refused update changes
        no weight."""
        if req.target_modules not in (None, ["transformer"]):
            raise ValueError(f"target_modules {req.target_modules}: the toy's only module is 'transformer'")
        if len(req.serialized_named_tensors) != 1:
            raise ValueError("serialized_named_tensors: one entry (the toy engine has one rank)")
        t0 = time.perf_counter()
        if req.load_format == FLAT:
            named = flat_bucket.unflatten(deserialize_payload(req.serialized_named_tensors[0]))
        elif req.load_format is None:
            named = deserialize_named_tensors(req.serialized_named_tensors[0])
        else:
            raise ValueError(f"load_format {req.load_format!r}: null (a list of named tensors) or {FLAT!r}")
        t1 = time.perf_counter()
        with torch.no_grad():
            if req.weight_update_mode == LORA_MERGE:
                if req.lora_alpha is None or req.lora_rank is None or req.lora_rank < 1:
                    raise ValueError("lora_merge needs lora_alpha and lora_rank >= 1")
                n = self.folds.apply(named, req.lora_alpha, req.lora_rank)
            elif req.weight_update_mode is None:
                unknown = [m for m, t in named if m not in self.params or self.params[m].shape != t.shape]
                if unknown:
                    raise ValueError(f"no transformer weight of that name and shape: {unknown[:3]}")
                for m, t in named:
                    self.params[m].copy_(t)
                n = len(named)
            else:
                raise ValueError(f"weight_update_mode {req.weight_update_mode!r}: null or {LORA_MERGE!r}")
        if self.toy.device.type == "cuda":  # the pushed tensors are the trainer's memory: done with them first
            torch.cuda.synchronize(self.toy.device)
        t2 = time.perf_counter()
        return (f"Updated {n} transformer weights ({req.weight_update_mode or 'full'}): received in "
                f"{(t1 - t0) * 1e3:.2f} ms, applied in {(t2 - t1) * 1e3:.2f} ms.")


def _refusal(req: RolloutRequest, toy: DiffusionToy) -> str | None:
    """What the toy engine cannot do, named by field with the fix; None when it can serve the request."""
    size = toy.latent_shape[1]
    checks = [
        (req.prompt not in toy.prompts, f"prompt {req.prompt!r} is not one of the toy's prompts "
                                        f"({toy.prompts[0]} ... {toy.prompts[-1]})"),
        (req.rollout_sde_type != "sde", f"rollout_sde_type {req.rollout_sde_type!r}: only 'sde' is built"),
        (req.rollout_log_prob_no_const, "rollout_log_prob_no_const: only the full log-prob is built; send false"),
        (req.guidance_scale is not None and req.guidance_scale > 1 and toy.negative is None,
         "guidance_scale > 1: this toy has no unconditional embedding (made before guidance was built): remake it "
         "with `kora make-toy --diffusion`, or send 1"),
        (req.negative_prompt not in (None, ""), f"negative_prompt {req.negative_prompt!r}: the toy's only "
                                                "negative is its unconditional embedding (the empty prompt); omit it "
                                                "or send \"\""),
        (any(v not in (None, size) for v in (req.width, req.height)), f"width/height: the toy's images are "
                                                                      f"{size}x{size}; omit them or send {size}"),
        (req.rollout_sde_step_indices is not None or req.rollout_return_step_indices is not None,
         "rollout_sde_step_indices / rollout_return_step_indices: step filters are not built; omit them"),
        (not 0 < req.rollout_noise_level < 10, "rollout_noise_level must be in (0, 10)"),
        (not 0 < (req.num_inference_steps or 1) <= MAX_STEPS, f"num_inference_steps must be in 1..{MAX_STEPS}"),
        (not 0 < (req.num_outputs_per_prompt or 1) <= MAX_OUTPUTS,
         f"num_outputs_per_prompt must be in 1..{MAX_OUTPUTS}"),
    ]
    return next((why for bad, why in checks if bad), None)


def rollout(toy: DiffusionToy, req: RolloutRequest, default_steps: int = 10) -> list[dict[str, Any]]:
    """Serve one request: num_outputs_per_prompt SDE samples of the prompt, each sliced into its own response."""
    n = req.num_outputs_per_prompt or 1
    guidance = req.guidance_scale if req.guidance_scale is not None and req.guidance_scale > 1 else 1.0  # SGLang's
    seed = req.seed if req.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    ids = torch.full((n,), toy.prompts.index(req.prompt), dtype=torch.long)
    timesteps, sigmas = flow_grpo.schedule(toy.scheduler, req.num_inference_steps or default_steps)
    t0 = time.monotonic()
    traj = flow_grpo.sample(velocity_fn(toy, ids, guidance=guidance), toy.latent_shape, timesteps,
                            sigmas, req.rollout_noise_level,
                            [torch.Generator().manual_seed(seed + i) for i in range(n)], toy.device)
    elapsed = time.monotonic() - t0
    request_id = uuid.uuid4().hex
    # the final latent's entry closes the trajectory at t = 0 (sglang appends it as step T)
    step_timesteps = torch.cat([timesteps, timesteps.new_zeros(1)])
    out = []
    for i in range(n):
        resp: dict[str, Any] = {"request_id": request_id, "prompt": req.prompt, "seed": seed,
                                "generated_output": encode_tensor(traj.images[i]), "inference_time_s": elapsed,
                                "peak_memory_mb": None}
        if req.rollout:
            resp["rollout_log_probs"] = encode_tensor(traj.log_probs[i])  # [T]
            resp["dit_trajectory"] = ({"latents": encode_tensor(traj.latents[i]),  # [T+1, C, H, W]
                                       "timesteps": encode_tensor(step_timesteps),  # [T+1]
                                       "sigmas": encode_tensor(sigmas)}  # [T+1]
                                      if req.rollout_return_dit_trajectory else None)
        out.append(resp)
    return out


def make_app(toy: DiffusionToy) -> web.Application:
    engine = ToyEngine(toy)
    # the work runs on one thread of its own, one request at a time (the toy's weights are shared), so the event
    # loop answers /health while a rollout or an update runs: the trainer's hang watch (orchestration/engine_watch.py)
    # asks it every second and takes a long silence for a hang
    work = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusion-engine")

    async def on_work(fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(work, fn)

    async def update_weights_from_tensor(request: web.Request) -> web.Response:
        try:
            req = UpdateWeightsFromTensorRequest.model_validate_json(await request.read())
            message = await on_work(lambda: engine.update(req))
        except (ValidationError, ValueError, KeyError) as e:  # a bad payload is the caller's: 400
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": message})

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=200)

    def generated(req: RolloutRequest) -> bytes:
        with torch.no_grad():
            return bytes(msgpack.packb(rollout(toy, req)))

    async def generate(request: web.Request) -> web.Response:
        try:
            req = RolloutRequest.model_validate_json(await request.read())
        except ValidationError as e:
            return web.json_response({"detail": f"Invalid rollout request: {e.errors()[0]['msg']} "
                                                f"({'.'.join(map(str, e.errors()[0]['loc']))})"}, status=400)
        why = _refusal(req, toy)
        if why is not None:
            return web.json_response({"detail": f"Invalid sampling params: {why}"}, status=400)
        return web.Response(body=await on_work(lambda: generated(req)), content_type="application/msgpack")

    faults = ExitAt()  # test-only fault knob (kora_engine/faults.py); inert unless its env var is set
    app = web.Application(client_max_size=1 << 20, middlewares=[faults.middleware] if faults.armed else [])
    app.router.add_get("/health", health)
    app.router.add_post("/rollout/generate", generate)
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="The reference diffusion engine for the toy (sglang-diffusion's routes)")
    p.add_argument("--toy", required=True, help="a directory `kora make-toy --diffusion` wrote")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the GPU the trainer shares: deployment Colocate)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this host has no CUDA device (rollout.gpusPerEngine 0 runs on the CPU)")
    toy = load_diffusion_toy(args.toy).to(args.device)
    toy.transformer.eval()
    web.run_app(make_app(toy), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
