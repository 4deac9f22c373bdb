"""The one HTTP client kora's trainer uses for every rollout engine: a real SGLang server
(sglang 0.5.23) or kora's reference engine (`kora_engine.lm`), which speak the same API.

    client = EngineClient("http://127.0.0.1:30000", api_key=None, admin_api_key=job_admin_key)
    client.wait_healthy(timeout_s=120)
    outs = client.generate([[1, 4, 5, 13]], {"max_new_tokens": 8, "temperature": 1.0}, lora_path="kora-policy")
    outs[0].output_ids, outs[0].output_logprobs, outs[0].finish_reason, outs[0].weight_version

Blocking calls and the broadcast. `init_weights_update_group`, `update_weights_from_distributed`
and `load_lora_adapter_from_distributed` return only after the engine has joined the group / received
the broadcast, and the trainer (rank 0) must join / broadcast at the same time. Submit the HTTP call
to the client's background threads, then do your side, then wait:

    futs = [c.submit(c.update_weights_from_distributed, bucket.metadata(), load_format=FLAT) for c in clients]
    group.broadcast(pack(bucket, tensors))           # rank 0 sends while the engines receive
    results = [f.result(timeout=300) for f in futs]  # raises EngineError if an engine refused

Every failure is an `EngineError` carrying the HTTP status and SGLang's message, whatever the
error body's shape (`{"error": {"message"}}`, `{"error": "..."}`, `{"object": "error", "message"}`,
`{"success": false, "message" | "error_message"}`, or plain text).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import requests
import torch
from requests.adapters import HTTPAdapter

from kora_trainer.wire.engine_auth import key_for
from kora_trainer.wire.protocol import FLAT, checksum, dtype_of

DEFAULT_GROUP = "weight_update_group"
T = TypeVar("T")


class EngineError(RuntimeError):
    """An engine answered with an error (or not at all: status 0)."""

    def __init__(self, route: str, status: int, message: str, body: Any = None):
        super().__init__(f"{route} -> HTTP {status}: {message}")
        self.route, self.status, self.message, self.body = route, status, message, body


@dataclass
class GenerateOutput:
    """One generated sequence (for n > 1, the n samples of a prompt are adjacent in the list)."""

    text: str | None
    output_ids: list[int]
    output_logprobs: list[float]  # raw log p(token) per output token (empty without return_logprob)
    finish_reason: dict[str, Any] | None
    weight_version: str | None
    prompt_tokens: int
    meta_info: dict[str, Any]

    @classmethod
    def from_json(cls, item: dict[str, Any]) -> GenerateOutput:
        meta = item.get("meta_info", {})
        entries = meta.get("output_token_logprobs") or []
        return cls(item.get("text"), list(item.get("output_ids") or [e[1] for e in entries]),
                   [float(e[0]) for e in entries], meta.get("finish_reason"), meta.get("weight_version"),
                   int(meta.get("prompt_tokens", 0)), meta)


def error_message(body: Any, text: str) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "error_message"):
            if body.get(key):
                return str(body[key])
    return text.strip() or "(empty body)"


class EngineClient:
    """`api_key` goes with /generate and the other NORMAL routes, `admin_api_key` with the admin ones
    (weights, LoRA, flush, pause, /kora/*; without one they get `api_key`, as SGLang falls back):
    wire/engine_auth.py says which route is which. Neither is sent on /health*."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 connect_timeout: float = 10.0, pool_size: int = 16, admin_api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = (connect_timeout, timeout)
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=pool_size, pool_maxsize=pool_size)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._api_key, self._admin_api_key = api_key or None, admin_api_key or None
        self._pool_size = pool_size
        self._executor: ThreadPoolExecutor | None = None

    # ---- plumbing ---------------------------------------------------------------------------

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self.session.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run a blocking call on the client's background threads (see the module docstring)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._pool_size, thread_name_prefix="engine-client")
        return self._executor.submit(fn, *args, **kwargs)

    def request(self, method: str, route: str, body: Any = None, timeout: float | None = None,
                params: dict[str, Any] | None = None) -> Any:
        """One call; returns the parsed JSON (or text); raises EngineError on any failure."""
        key = key_for(route, self._api_key, self._admin_api_key)
        headers = {"Authorization": f"Bearer {key}"} if key else None
        try:
            resp = self.session.request(method, self.base_url + route, json=body, params=params, headers=headers,
                                        timeout=(self.timeout[0], timeout or self.timeout[1]))
        except requests.RequestException as e:
            raise EngineError(route, 0, f"{type(e).__name__}: {e}") from e
        try:
            parsed: Any = resp.json()
        except ValueError:
            parsed = resp.text
        if resp.status_code >= 400 or (isinstance(parsed, dict) and parsed.get("success") is False):
            raise EngineError(route, resp.status_code, error_message(parsed, resp.text), parsed)
        return parsed

    def post(self, route: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        return self.request("POST", route, body, timeout)

    # ---- health, info -----------------------------------------------------------------------

    def health(self, timeout: float = 25.0) -> bool:
        """GET /health: True on 200; False on 503 or when the server does not answer."""
        try:
            return self.session.get(self.base_url + "/health", timeout=(self.timeout[0], timeout)).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout_s: float = 120.0, interval_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.health(timeout=max(1.0, min(25.0, deadline - time.monotonic()))):
                return
            time.sleep(interval_s)
        raise TimeoutError(f"engine {self.base_url} not healthy after {timeout_s:.0f}s")

    def model_info(self) -> dict[str, Any]:
        return cast("dict[str, Any]", self.request("GET", "/model_info"))

    # ---- generate ---------------------------------------------------------------------------

    def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: dict[str, Any] | list[dict[str, Any]] | None
                 = None, lora_path: str | Sequence[str | None] | None = None, return_logprob: bool = True,
                 rid: str | Sequence[str] | None = None, image_data: Sequence[Sequence[str]] | None = None,
                 **extra: Any) -> list[GenerateOutput]:
        """A batch of token-id prompts; returns len(input_ids) × n outputs in order.

        `lora_path` is an adapter *name* (one for all, or one per prompt; None = base model).
        `rid` names the requests (SGLang's GenerateReqInput.rid: one per prompt, or one string that becomes
        f"{rid}_{i}" per prompt; absent: the engine mints uuid4 hex ids) — the handle `abort_request` takes;
        multi-LoRA rollouts use `<adapter>::<uuid>` so one adapter's requests abort by prefix.
        `image_data`: each prompt's images (a list per prompt: SGLang's "list of lists of images"), base64 items
        (wire/vision.image_item), with the placeholders in its input_ids (wire/vision.py says which form).
        `extra` passes other GenerateReqInput fields through (e.g. logprob_start_len).
        Prefer one call per rollout batch; concurrent calls also work (SGLang batches them; the hf
        engine merges the calls that queue while a batch runs).
        """
        body: dict[str, Any] = {"input_ids": [list(p) for p in input_ids], "return_logprob": return_logprob, **extra}
        if sampling_params is not None:
            body["sampling_params"] = sampling_params
        if lora_path is not None:
            body["lora_path"] = lora_path if isinstance(lora_path, str) else list(lora_path)
        if rid is not None:
            body["rid"] = rid if isinstance(rid, str) else list(rid)
        if image_data is not None:
            body["image_data"] = [list(items) for items in image_data]
        out = self.post("/generate", body)
        return [GenerateOutput.from_json(item) for item in (out if isinstance(out, list) else [out])]

    # ---- weight sync ------------------------------------------------------------------------

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> dict[str, Any]:
        """Blocks until every member joined: submit() it, then join the group yourself."""
        return cast("dict[str, Any]", self.post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}))

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
        return cast("dict[str, Any]", self.post("/destroy_weights_update_group", {"group_name": group_name}))

    def update_weights_from_distributed(self, metadata: dict[str, list[Any]], group_name: str = DEFAULT_GROUP,
                                        load_format: str | None = None, weight_version: str | None = None,
                                        flush_cache: bool = True, abort_all_requests: bool = False,
                                        **extra: Any) -> dict[str, Any]:
        """`metadata` = Bucket.metadata() (names, dtypes, shapes[, byte_ranges]). Blocks until the
        broadcast arrived: submit() it, then broadcast. `load_format=FLAT` = one flat uint8 broadcast."""
        body = {**metadata, "group_name": group_name, "load_format": load_format, "weight_version": weight_version,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests, **extra}
        if body.get("byte_ranges") is None:
            body.pop("byte_ranges", None)
        return cast("dict[str, Any]", self.post("/update_weights_from_distributed", body))

    def update_weights_lora_merge(self, metadata: dict[str, list[Any]], lora_alpha: float, lora_rank: int,
                                  merge_fp32: bool = True, **kwargs: Any) -> dict[str, Any]:
        """kora EngineMerge: the bucket holds PEFT lora_A/lora_B pairs the engine folds into its pristine base."""
        return self.update_weights_from_distributed(
            metadata, weight_update_mode="lora_merge", lora_alpha=lora_alpha, lora_rank=lora_rank,
            merge_fp32=merge_fp32, **kwargs)

    def update_weights_from_tensor(self, serialized: str | Sequence[str], load_format: str | None = None,
                                   weight_version: str | None = None, flush_cache: bool = True,
                                   abort_all_requests: bool = False, **extra: Any) -> dict[str, Any]:
        """`serialized` = sync.serialize.serialize_named_tensors(...) (one per TP rank; a str = one rank).
        Same host only; keep the tensors alive until this returns. kora EngineMerge over IPC: pass
        weight_update_mode="lora_merge", lora_alpha=, lora_rank=, merge_fp32= in `extra`."""
        return cast("dict[str, Any]", self.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [serialized] if isinstance(serialized, str) else list(serialized),
            "load_format": load_format, "weight_version": weight_version, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests, **extra}))

    # ---- LoRA -------------------------------------------------------------------------------

    def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        return cast("dict[str, Any]", self.post("/load_lora_adapter", {"lora_name": name, "lora_path": path,
                                                                        "pinned": pinned}))

    def load_lora_adapter_from_tensors(self, name: str, config_dict: dict[str, Any], serialized: str | Sequence[str],
                                       pinned: bool = False, load_format: str | None = None) -> dict[str, Any]:
        """`config_dict` = the PEFT adapter_config.json contents; tensors named like PEFT's save (a {name: tensor}
        dict, or with `load_format` "flattened_bucket" one flat tensor and its metadata: wire/flat_bucket.py)."""
        body = {"lora_name": name, "config_dict": config_dict, "pinned": pinned,
                "serialized_named_tensors": [serialized] if isinstance(serialized, str) else list(serialized)}
        if load_format is not None:  # left out otherwise: the body stays what it was for every build
            body["load_format"] = load_format
        return cast("dict[str, Any]", self.post("/load_lora_adapter_from_tensors", body))

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        return cast("dict[str, Any]", self.post("/unload_lora_adapter", {"lora_name": name}))

    def load_lora_adapter_from_distributed(self, name: str, config_dict: dict[str, Any], metadata: dict[str, list[Any]],
                                           bucket_index: int = 0, num_buckets: int = 1,
                                           group_name: str = DEFAULT_GROUP, load_format: str | None = FLAT,
                                           weight_version: str | None = None) -> dict[str, Any]:
        """kora extension (not in SGLang): one bucket of an adapter over the weight-update group; after
        the last bucket the engine upserts the adapter under `name`. Blocks like update_weights_from_distributed."""
        body = {"lora_name": name, "config_dict": config_dict, **metadata, "group_name": group_name,
                "load_format": load_format, "bucket_index": bucket_index, "num_buckets": num_buckets,
                "weight_version": weight_version}
        if body.get("byte_ranges") is None:
            body.pop("byte_ranges", None)
        return cast("dict[str, Any]", self.post("/load_lora_adapter_from_distributed", body))

    def load_lora_adapter_over_group(self, name: str, config_dict: dict[str, Any], metadata: dict[str, list[Any]],
                                     group_name: str = DEFAULT_GROUP, upsert: bool = True,
                                     pinned: bool = False) -> dict[str, Any]:
        """sglang-miles' /load_lora_adapter_from_distributed (#27268, upsert #30913): the whole adapter in one
        call, its tensors broadcast one by one in `metadata["names"]` order from rank 0 (submit() it, then
        broadcast); `upsert` refreshes an adapter already loaded under `name` in place. Its body is the build's
        struct exactly (IO:2048 @ 94949da7); the engine answers LoRAUpdateOutput, without a version."""
        return cast("dict[str, Any]", self.post("/load_lora_adapter_from_distributed", {
            "lora_name": name, "config_dict": config_dict, "names": metadata["names"], "dtypes": metadata["dtypes"],
            "shapes": metadata["shapes"], "group_name": group_name, "pinned": pinned, "upsert": upsert}))

    def abort_request(self, rid: str, prefix: bool = False) -> None:
        """POST /abort_request {"rid"[, "prefix": true]}: the request with that rid, or (prefix, sglang-miles
        #30912 — a stock 0.5.23 ignores the flag and matches the rid exactly) every rid starting with it. The
        aborted /generate calls answer with finish_reason {"type": "abort", ...} and their partial output."""
        body: dict[str, Any] = {"rid": rid}
        if prefix:
            body["prefix"] = True
        self.post("/abort_request", body)

    def abort_all(self) -> None:
        """POST /abort_request {"abort_all": true}: every request in flight."""
        self.post("/abort_request", {"abort_all": True})

    def kora_state(self) -> dict[str, Any]:
        """kora's GET /kora/state (reference engine only; SGLang answers 404): held and in-flight requests per
        adapter, version and rid prefix, and the loaded adapters' versions."""
        return cast("dict[str, Any]", self.request("GET", "/kora/state"))

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict[str, Any]:
        """The version /generate reports from now on (SGLang's /update_weight_version)."""
        return cast("dict[str, Any]", self.post("/update_weight_version", {"new_version": new_version,
                                                    "abort_all_requests": abort_all_requests}))

    # ---- kora's fast sync (reference engine only: kora_engine/lm/fast_routes.py; SGLang answers 404) ----------

    def fast_sync_plan(self, mode: str, metadata: list[dict[str, list[Any]]], group_name: str = DEFAULT_GROUP,
                       slots: int = 2, lora_name: str | None = None,
                       config_dict: dict[str, Any] | None = None) -> dict[str, Any]:
        """The layout of every later fast push (`metadata`: one Bucket.metadata() per bucket), once."""
        return cast("dict[str, Any]", self.post("/kora/fast_sync/plan", {
            "mode": mode, "metadata": metadata, "group_name": group_name, "slots": slots, "lora_name": lora_name,
            "config_dict": config_dict}))

    def fast_sync_push(self, weight_version: str, group_name: str = DEFAULT_GROUP, verify: bool = False
                       ) -> dict[str, Any]:
        """One push of the planned buckets; blocks until the engine applied it: submit() it, then broadcast."""
        return cast("dict[str, Any]", self.post("/kora/fast_sync/push", {
            "weight_version": weight_version, "group_name": group_name, "verify": verify}))

    def colocated(self, step: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """kora's colocated fast path (kora_engine/lm/colocated_routes.py): step is plan, begin, push or abort."""
        return cast("dict[str, Any]", self.post(f"/kora/colocated/{step}", body, timeout))

    # ---- control ----------------------------------------------------------------------------

    def flush_cache(self, timeout: float = 0.0) -> str:
        return cast("str", self.request("POST", "/flush_cache", params={"timeout": timeout}))

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return cast("dict[str, Any]", self.post("/pause_generation", {"mode": mode}))

    def continue_generation(self) -> dict[str, Any]:
        return cast("dict[str, Any]", self.post("/continue_generation", {}))


def applied_checksum(metadata: dict[str, list[Any]], tensors: dict[str, torch.Tensor]) -> str:
    """The `checksum` an engine reports for one /update_weights_from_distributed call: protocol.checksum
    over the tensors this bucket completed (a split tensor counts in the bucket holding its last byte)."""
    ranges = metadata.get("byte_ranges")
    done = []
    for i, name in enumerate(metadata["names"]):
        numel = 1
        for d in metadata["shapes"][i]:
            numel *= int(d)
        total = numel * dtype_of(metadata["dtypes"][i]).itemsize
        if ranges is None or int(ranges[i][1]) == total:
            done.append((name, tensors[name]))
    return checksum(done)
