"""kora's reference rollout engine: an HTTP server that speaks SGLang's API (sglang 0.5.23).

    python -m kora_engine.lm --model-path DIR [--host 127.0.0.1] [--port N]
        [--device cpu|cuda] [--dtype auto|float32|bfloat16] [--max-loras-per-batch N]
        [--max-lora-rank R] [--api-key K] [--admin-api-key K] [--num-threads T] [--disable-fast-sync]
        [--max-body-bytes N] [--max-sequences-per-call N] [--body-timeout-s S]

The keys may come from the environment instead (KORA_ENGINE_API_KEY, KORA_ENGINE_ADMIN_API_KEY), which
is how kora's launcher passes them: argv is visible to every user through `ps`. Who may call what is
SGLang's rule (wire/engine_auth.py): /health*, /ready, /metrics always open; the weight, LoRA, flush,
pause and /kora/* routes need the admin key when set (else the api key when set); /generate and
/model_info need the api key only when one is set; a refusal is 401 {"error": "Unauthorized"}.

SGLang cannot run on our CPU machines, so this server is its stand-in (`rollout.engine: hf`):
tests, the local demo and the GPU benchmarks drive it through the same client and the same
routes, fields, defaults, response shapes and error bodies as a real SGLang server
(../shared/SGLANG_API.md cites the SGLang source lines). It holds an HF model loaded with
`AutoModelForCausalLM.from_pretrained` and generates with a plain KV-cached loop, one batch per
`/generate` call (engine_model.py). Log-probs are the raw `log_softmax` of the model's logits
for each sampled token — temperature, penalties and filters are NOT applied to them — so the
trainer can compare them with its own policy log-probs.

Routes (SGLang's): /generate, /health, /health_generate, /model_info, /get_model_info,
/init_weights_update_group, /destroy_weights_update_group, /update_weights_from_distributed,
/update_weights_from_tensor, /load_lora_adapter, /load_lora_adapter_from_tensors,
/unload_lora_adapter, /update_weight_version, /flush_cache, /pause_generation, /continue_generation,
/abort_request (with sglang-miles' `prefix` flag, #30912: `{"rid": "<adapter>::", "prefix": true}`).

kora extensions — SGLang 0.5.23 has no route or field for these:
- `POST /load_lora_adapter_from_distributed` {lora_name, config_dict, names, dtypes, shapes,
  byte_ranges?, group_name, load_format, bucket_index, num_buckets, weight_version?}: the adapter's
  HF-PEFT tensors arrive in buckets over the weight-update group; after the last bucket the
  adapter under lora_name is replaced atomically (upsert). A stock SGLang cannot receive an
  adapter over a process group; there the trainer unloads and reloads the adapter from a PEFT
  directory or from tensors (`/load_lora_adapter_from_tensors`, same host only).
- EngineMerge: `/update_weights_from_distributed` and `/update_weights_from_tensor` accept
  `weight_update_mode: "lora_merge"`, `lora_alpha`, `lora_rank`, `merge_fp32`: the tensors are
  PEFT lora_A/lora_B pairs that the engine folds into a pristine copy of its base,
  W = W0 + (alpha/rank)·B·A (fp32 then rounded once when merge_fp32); a fused 3-D expert parameter
  (PEFT `target_parameters`, grouped layout) gets B_e·A_e per expert, and a router pair is refused
  (SPEC rule 5: router LoRA is Adapter mode only). A stock SGLang LLM engine
  ignores these fields (unknown keys) and would try to load lora_A/lora_B as weights and fail;
  the mode comes from sglang-diffusion (miles' `LORA_IPC_WEIGHT_UPDATE_MODE`).
- `POST /kora/fast_sync/plan` and `POST /kora/fast_sync/push` (fast_sync_routes.py): the trainer's fast path
  for Merge and Adapter mode over the weight-update group — the bucket layout sent once, then per push one HTTP
  call while the buckets are broadcast, received straight into the parameters / a ring of adapter buffers.
  `--disable-fast-sync` turns them off (404, like SGLang).
- `POST /kora/colocated/{plan,begin,push,abort}` (colocated_routes.py): the same for a trainer on this engine's
  device: the engine's weights / a ring of adapter buffers mapped once (CUDA IPC, shared memory on CPU), each
  push written straight into them by the trainer; off with `--disable-fast-sync` too.
- `GET /kora/state` {held_requests, receiving, in_flight, in_flight_by_adapter, in_flight_by_adapter_version,
  in_flight_by_rid_prefix, adapters}: the /generate calls a pause holds, the weight-update receives under way
  (waiting in their broadcasts), the admitted requests not yet answered (per adapter name, per adapter
  version, per `<adapter>::` rid prefix), and each loaded adapter's current source / version / lora_id.
- Weight-update responses add `weight_version` and `checksum` (`sync.protocol.checksum` of the
  tensors the call applied, in order — `client.applied_checksum` computes the same on the sender;
  for the adapter route: of the whole adapter, on its last bucket). `/model_info` adds
  `kora_engine: "hf"`. A request served by an adapter pushed with a `weight_version` reports that
  version in `meta_info.weight_version` (per-adapter staleness); otherwise the server's version.
  `/load_lora_adapter_from_tensors` answers with the `checksum` of the adapter it loaded too (SGLang
  gives that route no version: a trainer sets one with `/update_weight_version` afterwards).

Differences from SGLang that a caller can see: no prefix cache (`/flush_cache` only checks for
idle; each batch builds its KV cache afresh with the adapter objects its requests hold, so no KV is ever
reused across adapter versions); no constrained decoding (json_schema/regex/ebnf → 400); `stream: true` sends one final
chunk per item; `/unload_lora_adapter` returns at once (requests already running keep the adapter
object they were admitted with); /generate calls that queue while a batch runs are merged into
the next batch (SGLang batches continuously).

Hostile input gets a 4xx with a message, never a 5xx, a reset or a hang (tests/unit/test_hostile_input.py sends
~700 such requests). Where SGLang has an answer it is SGLang's: a body that is not JSON, or not UTF-8, is
FastAPI's 400 "JSON decode error"; `input_ids` at or past the vocab size, a prompt as long as the context and a
prompt + explicit max_new_tokens past it are the tokenizer manager's 400s with its messages; an unknown path or
method is FastAPI's 404 / 405 `{"detail": ...}` (HEAD is served wherever GET is, as Starlette does). kora's own
additions, each a 4xx naming the field: negative ids (SGLang 0.5.23 checks only the upper end), NaN /
Infinity / numbers past a double (Python's json reads them), integers past their serde type (i32 ids, i64
counts), a stop_regex that does not compile, prompts x n over `--max-sequences-per-call` (65536), a body over
`--max-body-bytes` (64 MiB; SGLang sets no limit) as a 413, and a body that has not all arrived within
`--body-timeout-s` (60 s) as a 408. A request line or header aiohttp's parser cannot read is its 400 in text/plain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from kora_engine.faults import ExitAt, HoldAdapter
from kora_engine.lm import request_bodies as rq
from kora_engine.lm import strict
from kora_engine.lm.adapter_registry import AdapterRegistry
from kora_engine.lm.colocated_routes import ColocatedRoutes
from kora_engine.lm.contract import generate_contract_error
from kora_engine.lm.fast_routes import FastSyncRoutes
from kora_engine.lm.generate_io import GenerateLimits, format_result, parse_generate
from kora_engine.lm.inflight import InFlight
from kora_engine.lm.lora_adapters import pair_lora_tensors
from kora_engine.lm.model import CallBatcher, EngineModel, GenRequest
from kora_engine.lm.record import CallRecord
from kora_engine.lm.sampling import SamplingParams
from kora_engine.lm.weight_sync import BucketMeta, WeightReceiver
from kora_trainer import heap
from kora_trainer.config.sglang_builds import Build
from kora_trainer.wire import colocated_words, engine_auth, flat_bucket
from kora_trainer.wire.protocol import FLAT, checksum
from kora_trainer.wire.serialize import deserialize_adapter_tensors, deserialize_named_tensors, deserialize_payload

log = logging.getLogger("kora.hf_engine")

HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT
MAX_BODY_BYTES = 64 << 20  # kora's body limit (--max-body-bytes): a larger body is a 413; SGLang sets none
MAX_SEQUENCES_PER_CALL = 1 << 16  # prompts x n of one /generate call (--max-sequences-per-call)
BODY_TIMEOUT_S = 60.0  # a body must have arrived whole within this (--body-timeout-s), else 408


def _json(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json", headers=headers)


@dataclass
class _AdapterStaging:
    """Buckets of one adapter received so far (kora's /load_lora_adapter_from_distributed)."""

    next_bucket: int
    num_buckets: int
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)


class HFEngineServer:
    def __init__(self, engine: EngineModel, api_key: str | None = None, admin_api_key: str | None = None,
                 workers: int = 32, fast_sync: bool = True, max_body_bytes: int = MAX_BODY_BYTES,
                 max_sequences: int = MAX_SEQUENCES_PER_CALL, body_timeout_s: float = BODY_TIMEOUT_S,
                 build: Build | None = None):
        self.engine = engine
        self.build = build  # strict mode (strict.py): that SGLang build's routes and fields, no kora extension
        fast_sync = fast_sync and build is None
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.limits = GenerateLimits(engine.vocab_size, engine.max_context, max_sequences)
        self.fast_sync = FastSyncRoutes(self) if fast_sync else None
        self.adapters = AdapterRegistry(engine)
        self.colocated = ColocatedRoutes(self) if fast_sync else None  # hooks into adapters' lookups
        self.batcher = CallBatcher(engine)
        self.inflight = InFlight()  # admitted /generate requests, for /abort_request and /kora/state
        self.receiver = WeightReceiver()
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="engine")
        # every group operation on one thread: collectives must be issued in order
        self.sync_pool = ThreadPoolExecutor(1, thread_name_prefix="weight-sync")
        self._staging: dict[str, _AdapterStaging] = {}
        self._running = asyncio.Event()  # cleared by /pause_generation (created inside the server's loop)
        self._running.set()
        self._held = 0  # /generate calls waiting for /continue_generation (GET /kora/state)
        self.exit_at = ExitAt()  # test-only fault knob (faults.py); inert unless its env var is set
        self.hold = HoldAdapter()  # test-only, as exit_at
        self.record = CallRecord()  # test-only record of every call (record.py); inert unless its env var is set

    # ---- app, auth --------------------------------------------------------------------------

    def app(self) -> web.Application:
        middlewares = [self._auth, self._bad_requests]
        if self.exit_at.armed:  # test-only (faults.py)
            middlewares.insert(0, self.exit_at.middleware)
        if self.record.path is not None:  # test-only (record.py): outermost, so it sees every answer
            middlewares.insert(0, self.record.middleware)
        app = web.Application(middlewares=middlewares, client_max_size=self.max_body_bytes)
        # who may call each route is wire/engine_auth.py's (SGLang's) rule, by path: one middleware checks it
        routes: list[tuple[str, str, Any]] = [
            ("*", "/generate", self.generate),
            ("GET", "/health", self.health),
            ("GET", "/health_generate", self.health),
            ("GET", "/model_info", self.model_info),
            ("GET", "/get_model_info", self.get_model_info),
            ("GET", "/kora/state", self.kora_state),
            ("POST", "/init_weights_update_group", self.init_weights_update_group),
            ("POST", "/destroy_weights_update_group", self.destroy_weights_update_group),
            ("POST", "/update_weights_from_distributed", self.update_weights_from_distributed),
            ("POST", "/update_weights_from_tensor", self.update_weights_from_tensor),
            ("POST", "/load_lora_adapter", self.load_lora_adapter),
            ("POST", "/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors),
            ("POST", "/load_lora_adapter_from_distributed", self.load_lora_adapter_from_distributed),
            ("POST", "/unload_lora_adapter", self.unload_lora_adapter),
            ("POST", "/update_weight_version", self.update_weight_version),
            ("*", "/flush_cache", self.flush_cache),
            ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/abort_request", self.abort_request),
            ("POST", "/continue_generation", self.continue_generation),
        ]
        if self.fast_sync is not None:
            routes += self.fast_sync.routes()
        if self.colocated is not None:
            routes += self.colocated.routes()
        for method, path, handler in routes:
            if self.build is not None and not self.build.has(path):
                continue  # strict: FastAPI's 404, as the build answers a route it does not have
            # SGLang serves these on GET|POST (flush_cache) or POST|PUT (generate); Starlette adds HEAD to every GET
            methods = (("GET", "POST") if path == "/flush_cache" else ("POST", "PUT")) if method == "*" else (method,)
            for m in methods + (("HEAD",) if "GET" in methods else ()):
                app.router.add_route(m, path, handler)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _shutdown(self, _app: web.Application) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sync_pool.shutdown(wait=False, cancel_futures=True)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """SGLang's `decide_request_auth` for every request, before its route runs (an unknown path is a
        NORMAL route there too: with an api key set it is a 401 before it is a 404)."""
        normal = self.build.normal_routes if self.build is not None else frozenset()
        if not engine_auth.allowed(request.method, request.path, request.headers, self.api_key, self.admin_api_key,
                                   normal):
            return _json(engine_auth.UNAUTHORIZED, 401)
        response: web.StreamResponse = await handler(request)
        return response

    @web.middleware
    async def _bad_requests(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """SGLang's `validation_exception_handler`, app-wide as there: a body that does not parse is a 400.
        aiohttp's own refusals (404 unknown path, 405 method, 413 body over the limit) get FastAPI's JSON
        `{"detail": ...}` instead of aiohttp's text, as a FastAPI server answers them."""
        try:
            response: web.StreamResponse = await handler(request)
        except rq.BadRequest as e:
            return _json(rq.bad_request_body(str(e)), 400)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _json({"detail": self._detail(e)}, e.status, {k: v for k, v in e.headers.items()
                                                                   if k.lower() == "allow"})
        return response

    def _detail(self, e: web.HTTPException) -> str:
        if isinstance(e, web.HTTPRequestEntityTooLarge):
            return (f"Request body over this engine's limit of {self.max_body_bytes} bytes (--max-body-bytes): "
                    "send a smaller body")
        return str(e.reason)

    async def _run(self, fn: Any, *args: Any, sync: bool = False) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.sync_pool if sync else self.pool, fn, *args)

    async def _json_body(self, request: web.Request) -> Any:
        """The body as JSON (a 400 for anything else); over --max-body-bytes aiohttp raises its 413, and a body
        that has not all come within --body-timeout-s (a Content-Length larger than what is sent) is a 408."""
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout_s)
        except TimeoutError:
            raise web.HTTPRequestTimeout(reason=f"The request body did not arrive within {self.body_timeout_s:g} s "
                                                "(--body-timeout-s): send as many bytes as Content-Length says"
                                         ) from None
        return rq.json_body(raw)

    async def _body(self, request: web.Request, model: type[rq.Body]) -> rq.Body:
        return rq.parse(model, strict.request_body(self.build, request.path, await self._json_body(request)))

    # ---- generate ---------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        problem = generate_contract_error(body)
        if problem is not None:
            return _json({"error": problem}, 400)
        engine = self.engine
        try:
            parsed = parse_generate(body, lambda t: engine.tokenizer(t)["input_ids"], self.adapters.resolve,
                                    self.limits, engine.image_inputs if engine.vision_tokens else None,
                                    engine.vision_tokens)
            # tracked from here, so /abort_request reaches a request a pause holds too (sglang-miles #30912)
            with self.inflight.track(parsed.requests):
                if await self._admitted():  # it waited out a pause: it gets the adapters served now
                    for r in parsed.requests:
                        if r.adapter is not None:
                            r.adapter = self.adapters.resolve(r.adapter.name)
                await self.hold.hold(parsed.requests)  # test-only (faults.py): inert unless its env var is set
                results = await self._run(self.batcher.generate, parsed.requests)
        except ValueError as e:
            return _json(rq.value_error_body(str(e)), 400)
        outs = [format_result(r, parsed.return_prompt_token_ids, engine.decode_token) for r in results]
        if parsed.stream:  # one cumulative chunk per item (generation is not incremental here)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, out in enumerate(outs):
                chunk = out if parsed.single else {**out, "index": i}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return _json(outs[0] if parsed.single else outs)

    async def _admitted(self) -> bool:
        """While paused, new requests wait here (SGLang queues them), counted as held; True if it waited."""
        if self._running.is_set():
            return False
        self._held += 1
        try:
            await self._running.wait()
        finally:
            self._held -= 1
        return True

    # ---- health, info -----------------------------------------------------------------------

    def _probe(self) -> None:
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        self.engine.generate([GenRequest(input_ids=[0], params=params)], admit=False)

    async def health(self, request: web.Request) -> web.Response:
        """SGLang's probe: a 1-token generate from input_ids [0]; any work in progress already proves the
        engine alive (SGLang counts any scheduler output), so a busy or paused engine answers at once."""
        control = self.engine.control
        if self.engine.lock.locked() or control.paused or control.active:
            return web.Response(status=200)
        try:
            await asyncio.wait_for(self._run(self._probe), HEALTH_CHECK_TIMEOUT_S)
        except Exception:
            log.exception("health check failed")
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        e = self.engine
        return _json({
            "model_path": e.model_path, "served_model_name": e.model_path, "tokenizer_path": e.model_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": e.weight_version,
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
            "has_image_understanding": e.vision_tokens is not None, "has_audio_understanding": False,
            "model_type": getattr(e.config, "model_type", None),
            "architectures": getattr(e.config, "architectures", None),
            **({} if self.build is not None else {"kora_engine": "hf"}),
        })

    async def kora_state(self, request: web.Request) -> web.Response:
        """kora: what a caller cannot see otherwise (tests wait on it instead of sleeping)."""
        return _json({"held_requests": self._held, "receiving": self.receiver.receiving, **self.inflight.state(),
                      "adapters": self.adapters.versions()})

    async def get_model_info(self, request: web.Request) -> web.Response:
        log.warning("Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
                    "Please use '/model_info' instead.")
        return await self.model_info(request)

    # ---- weight-update group ----------------------------------------------------------------

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        b = await self._body(request, rq.InitWeightsUpdateGroupReqInput)
        problem = rq.group_problem(b)
        if problem is not None:  # refused before joining: a join waits (up to its timeout) for the other ranks
            return _json({"success": False, "message": f"Failed to initialize custom process group: {problem}."}, 400)
        ok, message = await self._run(self.receiver.init_group, b.master_address, b.master_port, b.rank_offset,
                                      b.world_size, b.group_name, b.backend, self.engine.device, sync=True)
        return _json({"success": ok, "message": message}, 200 if ok else 400)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        b = await self._body(request, rq.DestroyWeightsUpdateGroupReqInput)
        ok, message = await self._run(self.receiver.destroy_group, b.group_name, sync=True)
        return _json({"success": ok, "message": message}, 200 if ok else 400)

    # ---- weight updates ---------------------------------------------------------------------

    def _apply(self, named: list[tuple[str, torch.Tensor]], b: rq.WeightUpdate) -> None:
        """Full weights, or (weight_update_mode lora_merge) A/B pairs folded into the pristine base."""
        mode = b.weight_update_mode
        if mode in (None, "full"):
            self.engine.load_weights(named)
            return
        if mode != "lora_merge":
            raise ValueError(f"Unknown weight_update_mode={mode}")
        if b.lora_alpha is None or not b.lora_rank:
            raise ValueError("weight_update_mode lora_merge needs lora_alpha and lora_rank")
        self.engine.merge_lora(pair_lora_tensors(named), b.lora_alpha, b.lora_rank, b.merge_fp32)

    def _weights_done(self, named: list[tuple[str, torch.Tensor]], b: rq.WeightUpdate, message: str) -> dict[str, Any]:
        if b.weight_version is not None:
            self.engine.weight_version = b.weight_version
            message += f" Weight version updated to {b.weight_version}."
        return {"success": True, "message": message, "weight_version": self.engine.weight_version,
                "checksum": checksum(named)}

    def _abort_if_asked(self, abort_all_requests: bool) -> None:
        if abort_all_requests:
            self.engine.control.abort_all()

    def _update_from_distributed(self, b: rq.UpdateWeightsFromDistributedReqInput) -> dict[str, Any]:
        meta = BucketMeta(b.names, b.dtypes, b.shapes, b.byte_ranges, b.load_format)
        self._abort_if_asked(b.abort_all_requests)
        named = self.receiver.receive(meta, b.group_name)
        try:
            self._apply(named, b)
        except Exception as e:
            return {"success": False, "message": f"Failed to update parameter online: {e}. The full weights of the "
                                                 "ModelRunner are partially updated. Please discard the whole weights."}
        return self._weights_done(named, b, "Succeeded to update parameter online.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        b = await self._body(request, rq.UpdateWeightsFromDistributedReqInput)
        try:
            out = await self._run(self._update_from_distributed, b, sync=True)
        except Exception as e:  # any failure is the route's {"success": false, "message"} (SGLang reports them so)
            log.exception("update_weights_from_distributed failed")
            return _json({"success": False, "message": str(e)}, 400)
        return _json(strict.response_body(self.build, out), 200 if out["success"] else 400)

    def _unflatten(self, payload: str) -> list[tuple[str, torch.Tensor]]:
        """A flattened bucket's tensors; a build's strict mode unpickles and reads its metadata as SGLang does."""
        strict = self.build is not None
        return flat_bucket.unflatten(deserialize_payload(payload, strict), attrs_only=strict)

    def _update_from_tensor(self, b: rq.UpdateWeightsFromTensorReqInput) -> dict[str, Any]:
        payload = b.serialized_named_tensors[self.receiver.tp_rank]
        if b.load_format == FLAT:
            named = self._unflatten(payload)
        elif b.load_format in (None, "direct"):
            named = deserialize_named_tensors(payload, strict=self.build is not None)
        else:
            raise ValueError(f"Unknown load_format={b.load_format}")
        self._abort_if_asked(b.abort_all_requests)
        self._apply(named, b)
        return self._weights_done(named, b, "Success")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        b = await self._body(request, rq.UpdateWeightsFromTensorReqInput)
        try:
            out = await self._run(self._update_from_tensor, b)
        except Exception as e:  # a bad payload (unpickling, names, shapes) fails the call, not the server
            log.exception("update_weights_from_tensor failed")
            return _json({"success": False, "message": str(e)}, 400)
        return _json(strict.response_body(self.build, out))

    # ---- LoRA -------------------------------------------------------------------------------

    async def _lora_call(self, request: web.Request, model: type[rq.Body],
                         fn: Callable[[rq.Body], Awaitable[dict[str, Any] | None]]) -> web.Response:
        b = await self._body(request, model)
        try:
            extra = await fn(b) or {}
        except Exception as e:  # SGLang answers every failed LoRA operation with success false + the message
            return _json(rq.lora_update_output(False, str(e), self.adapters.loaded()), 400)
        return _json({**rq.lora_update_output(True, "", self.adapters.loaded()),
                      **strict.response_body(self.build, extra)})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        async def do(b: rq.LoadLoRAAdapterReqInput) -> None:
            await self._run(self.adapters.load_from_dir, b.lora_name, b.lora_path)

        return await self._lora_call(request, rq.LoadLoRAAdapterReqInput, do)

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        def load(b: rq.LoadLoRAAdapterFromTensorsReqInput) -> dict[str, Any]:
            if b.added_tokens_config:
                raise ValueError("LoRA adapters that add tokens are not supported.")
            # a build's strict mode takes only SGLang's shapes, a dict or (0.5.17's tp_worker.py:241) a flattened
            # bucket; kora's own mode takes a list of pairs too. SGLang ignores any other load_format here.
            payload = b.serialized_named_tensors[self.receiver.tp_rank]
            if b.load_format == FLAT and (self.build is None or self.build.flat_in_memory):
                named = self._unflatten(payload)
            else:
                named = deserialize_adapter_tensors(payload, pairs_ok=self.build is None)
            self.adapters.load_from_tensors(b.lora_name, b.config_dict, named)
            return {"checksum": checksum(named)}  # kora: what was applied, for the sender to compare

        async def do(b: rq.LoadLoRAAdapterFromTensorsReqInput) -> dict[str, Any]:
            out: dict[str, Any] = await self._run(load, b)
            return out

        return await self._lora_call(request, rq.LoadLoRAAdapterFromTensorsReqInput, do)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        async def do(b: rq.UnloadLoRAAdapterReqInput) -> None:
            self.adapters.unload(b.lora_name)

        return await self._lora_call(request, rq.UnloadLoRAAdapterReqInput, do)

    def _adapter_bucket(self, b: rq.LoadLoRAAdapterFromDistributedReqInput) -> dict[str, Any]:
        name, index, total = b.lora_name, b.bucket_index, b.num_buckets
        meta = BucketMeta(b.names, b.dtypes, b.shapes, b.byte_ranges, b.load_format)
        stream = f"adapter:{name}"
        if index == 0:
            self.receiver.reset_stream(b.group_name, stream)
        # receive first, whatever the bookkeeping says: the trainer is already broadcasting
        named = self.receiver.receive(meta, b.group_name, stream)
        staging = self._staging.get(name)
        if index == 0:
            staging = self._staging[name] = _AdapterStaging(0, total)
        if staging is None or index != staging.next_bucket or total != staging.num_buckets or not 0 <= index < total:
            self._staging.pop(name, None)
            expected = staging.next_bucket if staging else 0
            raise ValueError(f"adapter {name}: got bucket {index} of {total}, expected bucket {expected}; "
                             "start again from bucket_index 0")
        staging.tensors.extend(named)
        staging.next_bucket += 1
        if staging.next_bucket < total:
            return {"weight_version": None, "checksum": None}
        del self._staging[name]
        if self.build is not None and not b.upsert and self.adapters.get(name) is not None:
            # sglang-miles refuses a loaded name without upsert (before its receive ⚠: here after, so the group
            # stays in step with a trainer that broadcast anyway)
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        adapter = self.adapters.upsert(name, b.config_dict, staging.tensors, b.weight_version)
        return {"weight_version": adapter.version, "checksum": checksum(staging.tensors)}

    async def load_lora_adapter_from_distributed(self, request: web.Request) -> web.Response:
        async def do(b: rq.LoadLoRAAdapterFromDistributedReqInput) -> dict[str, Any]:
            out: dict[str, Any] = await self._run(self._adapter_bucket, b, sync=True)
            return out

        return await self._lora_call(request, rq.LoadLoRAAdapterFromDistributedReqInput, do)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """SGLang's route: only the version label changes (the adapter routes carry none of their own)."""
        b = await self._body(request, rq.UpdateWeightVersionReqInput)
        self._abort_if_asked(b.abort_all_requests)
        self.engine.weight_version = b.new_version
        return _json({"success": True, "message": f"Weight version updated to {b.new_version}",
                      "new_version": b.new_version})

    # ---- control ----------------------------------------------------------------------------

    async def flush_cache(self, request: web.Request) -> web.Response:
        """No prefix cache to drop; succeed when idle (waiting up to ?timeout= seconds), as SGLang does."""
        try:
            timeout = float(request.query.get("timeout", "0"))
        except ValueError:
            raise rq.BadRequest("timeout must be a number") from None
        if not timeout <= threading.TIMEOUT_MAX:  # NaN too; past TIMEOUT_MAX a wait raises OverflowError
            raise rq.BadRequest(f"timeout must be a number of seconds up to {threading.TIMEOUT_MAX:.0f}, "
                                f"got {request.query['timeout']!r}")
        idle = await self._run(self.engine.control.wait_idle, max(timeout, 0.0))
        if idle:
            return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                     "running or waiting requests, the operation will not be performed.)\n")
        return web.Response(text="Timed out waiting for idle state." if timeout > 0 else "Flush cache failed.\n",
                            status=400)

    async def pause_generation(self, request: web.Request) -> web.Response:
        b = await self._body(request, rq.PauseGenerationReqInput)
        self._running.clear()
        self.engine.control.pause(b.mode)
        if b.mode == "abort":  # abort repeats until nothing is in flight
            await self._run(self.engine.control.wait_idle, None)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang's `/abort_request` (HS `abort_request`, IO `AbortReq`) with sglang-miles' `prefix` (#30912):
        200 with an empty body whether or not anything matched (inflight.py). A build's strict engine refuses the
        prefix form where the build has none (strict.abort_refusal)."""
        raw = await self._json_body(request)
        refused = strict.abort_refusal(self.build, raw)
        if refused is not None:
            return _json(rq.value_error_body(refused), 400)
        b = rq.parse(rq.AbortReq, strict.request_body(self.build, request.path, raw))
        self.inflight.abort(b.rid, b.prefix, b.abort_all)
        return web.Response(status=200)

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._body(request, rq.ContinueGenerationReqInput)
        self.engine.control.resume()
        self._running.set()
        return _json({"message": "Generation continued successfully.", "status": "ok"})


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The command line; `environ` (default: os.environ) gives the keys that no flag gave."""
    p = argparse.ArgumentParser(prog="python -m kora_engine.lm",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="HF checkpoint directory (config, safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-loras-per-batch", type=int, default=8,
                   help="distinct adapters (the base model counts as one) per forward batch, like SGLang")
    p.add_argument("--max-lora-rank", type=int, default=None, help="refuse adapters of a larger rank")
    p.add_argument("--api-key", default=None,
                   help=f"the key /generate and the other NORMAL routes need (default: ${engine_auth.API_KEY_ENV})")
    p.add_argument("--admin-api-key", default=None,
                   help="the key the weight, LoRA, flush, pause and /kora/* routes need "
                        f"(default: ${engine_auth.ADMIN_API_KEY_ENV}; the environment keeps it out of `ps`)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--disable-fast-sync", action="store_true",
                   help="no /kora/fast_sync/* or /kora/colocated/* routes (404, as SGLang): the trainer keeps "
                        "the HTTP path")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="a request body larger than this is refused with 413 (default: 64 MiB)")
    p.add_argument("--max-sequences-per-call", type=int, default=MAX_SEQUENCES_PER_CALL,
                   help="prompts x n one /generate call may ask for; more is a 400 (default: 65536)")
    p.add_argument("--body-timeout-s", type=float, default=BODY_TIMEOUT_S,
                   help="a request body not arrived whole within this many seconds is a 408 (default: 60)")
    p.add_argument("--sglang-build", default=None, choices=strict.BUILD_NAMES,
                   help="strict mode: only that SGLang build's routes and fields, kora's extensions off "
                        "(config/sglang_builds.py; default: SGLang 0.5.23's routes plus kora's)")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    environ = os.environ if environ is None else environ
    for attr, env in (("api_key", engine_auth.API_KEY_ENV), ("admin_api_key", engine_auth.ADMIN_API_KEY_ENV)):
        if getattr(args, attr) is None and environ.get(env):  # a flag wins; an empty variable is unset
            setattr(args, attr, environ[env])
    return args


async def _serve(args: argparse.Namespace) -> None:
    engine = EngineModel(args.model_path, args.device, args.dtype, args.max_loras_per_batch, args.max_lora_rank)
    server = HFEngineServer(engine, args.api_key, args.admin_api_key, fast_sync=not args.disable_fast_sync,
                            max_body_bytes=args.max_body_bytes, max_sequences=args.max_sequences_per_call,
                            body_timeout_s=args.body_timeout_s, build=strict.build_named(args.sglang_build))
    heap.freeze("the reference engine")  # the model and the imports: out of every later full collection
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    listener = site._server
    port = listener.sockets[0].getsockname()[1] if listener is not None else args.port  # type: ignore[attr-defined]
    print(json.dumps({"event": "ready", "engine": "hf", "url": f"http://{args.host}:{port}", "port": port}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for env in engine_auth.KEY_ENVS:  # read: nothing this process starts needs to inherit them
        os.environ.pop(env, None)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    signal.signal(signal.SIGTERM, colocated_words.unlink_fifos)  # no colocated wake FIFO outlives the engine
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
