"""The rollout manager: prompts in, scored samples out, through the engines' `/generate`.

Each step takes `rolloutBatchSize` prompts, asks for `nSamplesPerPrompt` samples of each, spreads the
prompts over the engines, and scores every response with the configured reward. In Adapter mode every
request carries `lora_path=kora-policy`, so generation runs through the adapter being trained.

Spreading, balanced and health-checked. A step first asks every engine's `/health` (at once, bounded);
an engine that fails it is out for the step. The step's prompts are cut into runs of consecutive prompts,
about CHUNKS_PER_ENGINE per engine left (one call in all when one engine is left: nothing to balance),
and each run is one `/generate` call sent to the engine holding the fewest requests among those with
room (fewer than IN_FLIGHT calls): half an engine's share goes out at once and the rest to whichever
engines free up first, so a slower or busier engine gets less. A call that fails for the engine's sake
(no answer, a connection cut, a 5xx) takes that engine out for the step and its run goes to the others,
each run at most once per engine; a refused request (4xx: it would be refused anywhere) or no engine left
fails the step with a RolloutError naming each engine and why. An engine that hangs (stopped, or wedged with its
socket open) would hold its call for the client's whole timeout; its worker's hang watch kills it after
rollout.engineHangSeconds instead, so the call fails and its run goes to the others — but the sync that follows
must reach every engine (a member of the weight-update group, or fed in memory) and fails, so the attempt stops
with EngineLost (engine_watch.py says why that, and not carrying on with fewer engines).
`stats["engine_requests"]` says how many requests each engine answered, `stats["engines_out"]` which were taken
out; `load` shows the step in progress (per engine: requests in flight, answered; requests not yet sent).

Request ids with a prefix (multi-LoRA: `<adapter>::<uuid>`) are held in `rids` while their call runs, so
`abort_prefix` can abort one adapter's requests by their exact rids on a build that cannot abort by prefix
(inflight_rids.py).

Every sample is its own request: the prompt repeated, a prompt's samples adjacent (the GRPO group
layout). SGLang's `n` is not used, because the `n` samples of one request share its `sampling_seed` and
would be the same draw.

Reproducible per step, when the run claims exact resume (`sglang_launcher.reproducible_rollouts`:
checkpoint.path set, deployment.async false): each request then carries its own `sampling_seed`, a pure
function of (algorithm.seed, step, prompt index in the step's batch, sample index). Both engines make a
seeded draw depend only on (seed, position) and the logits (SGLang with --enable-deterministic-inference,
which the launcher adds for such runs), so step t's rollouts depend only on the policy the engines serve
and on which prompts step t takes — not on which engine served a sample, nor on what shared its call or
its batch (tests/unit/test_rollout_engines.py runs one step on two engines either way round and on each
alone). Otherwise no seed is sent: the requests sample independently (a seeded
draw costs the reference engine ~30% more generation time on the toy, SGLang its batch-invariant kernels).
The prompts come from one seeded iterator; `position` counts the batches it has yielded, and `skip_to`
fast-forwards a fresh manager to a checkpoint's position on resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, cast

from kora_trainer.algorithm.rewards import RewardFn, Sample, reward_fn
from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.config import SyncMode, TrainerConfig
from kora_trainer.orchestration.data import Row, batches, load_rows
from kora_trainer.orchestration.inflight_rids import InFlightRids
from kora_trainer.orchestration.sglang_launcher import reproducible_rollouts
from kora_trainer.sync.sender import POLICY_ADAPTER
from kora_trainer.wire.engine_client import EngineClient, EngineError, GenerateOutput
from kora_trainer.wire.vision import (
    ImageInputs,
    VisionTokens,
    image_item,
    images_from_bytes,
    is_vision_language,
    load_image_processor,
    prompt_ids,
)

ADAPTER_SWAP_RETRIES = 5
CHUNKS_PER_ENGINE = 8  # a step is split into about this many calls per engine (the unit of balancing)
ABORT_WAIT_S = 30.0  # abort_prefix: how long it waits for the aborted calls to return
ABORT_REPEAT_S = 0.1  # abort_prefix: a call sent but not yet admitted missed its abort; it is sent again this often
IN_FLIGHT = 4  # calls one engine may hold at once: half its share, so the rest goes to whoever frees first
HEALTH_TIMEOUT_S = 30.0  # above the engines' own 20 s probe (SGLANG_HEALTH_CHECK_TIMEOUT)
SEED_MASK = 0x7FFF_FFFF  # 31 bits: SGLang keeps request seeds in an int32 tensor


def sampling_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The seed of sample `sample` of prompt `prompt` (its index in the step's batch) at `step`."""
    digest = hashlib.blake2b(f"kora/{seed}/{step}/{prompt}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & SEED_MASK


class Prompts:
    """Rows -> prompt token ids, as the engines and the trainer both take them. Text: the tokenizer (bos added). A VL
    job (`data.imageKey`): the chat template with the row's images first, each placeholder expanded to its image's
    token count (wire/vision.py), plus the images for the trainer's forward and the engines' image_data."""

    def __init__(self, model_path: str, image_key: str | None, tokenizer: Any, what: str = "data.imageKey"):
        """`image_key`: the data's image column (the job's data.imageKey, or an adapter's: `what` names it)."""
        from transformers import AutoConfig  # noqa: PLC0415 - transformers is heavy: loaded on use

        self.tokenizer = tokenizer
        self.vl = image_key is not None
        if self.vl:
            config = AutoConfig.from_pretrained(model_path)
            if not is_vision_language(config):
                raise ValueError(f"{what} {image_key!r} is set but model.path {model_path} is not a vision-language "
                                 "model (its config.json has no vision_config): unset data.imageKey or point "
                                 "model.path at a VL checkpoint")
            self.tokens = VisionTokens.of(config)
            self.image_processor = load_image_processor(model_path)

    def build(self, rows: list[Row]) -> tuple[list[list[int]], list[ImageInputs | None] | None,
                                             list[list[str]] | None]:
        """(prompt ids, each prompt's images or None for a text job, each prompt's image_data or None)."""
        if not self.vl:
            return [self.tokenizer(r.prompt)["input_ids"] for r in rows], None, None

        images: list[ImageInputs | None] = []
        ids: list[list[int]] = []
        for r in rows:
            im = images_from_bytes(self.image_processor, r.images) if r.images else None
            images.append(im)
            ids.append(prompt_ids(self.tokenizer, self.tokens, r.prompt, im) if im is not None
                       else self.tokenizer(r.prompt)["input_ids"])
        return ids, images, [[image_item(b) for b in r.images] for r in rows]


class RolloutError(RuntimeError):
    """A step's rollouts could not be generated: no engine left, a request refused, or out of time."""


@dataclass
class _Chunk:
    """Consecutive prompts of the step, sent in one /generate call: their g samples each, adjacent."""

    ids: list[list[int]]
    params: list[dict[str, Any]]
    images: list[list[str]] | None = None  # each request's image_data (a VL job), else None


@dataclass
class _Load:
    """The step in progress, per engine: what it holds now and what it served; readable from other threads."""

    outstanding: list[int]  # requests (samples) in flight
    served: list[int]  # requests answered
    queued: int = 0  # requests no engine holds yet (waiting for room, or to be retried)


class Rollout:
    def __init__(self, cfg: TrainerConfig, engine_urls: list[str], timeout_s: float = 600.0,
                 admin_api_key: str | None = None, api_key: str | None = None,
                 health_timeout_s: float = HEALTH_TIMEOUT_S, chunks_per_engine: int = CHUNKS_PER_ENGINE,
                 in_flight: int = IN_FLIGHT, calls_per_engine: int | None = None):
        """`engine_urls`: the job's engines (nothing is contacted here). `api_key` goes with /generate, as
        the engines' `--api-key` asks; `admin_api_key` would go with their admin routes, none of which
        the rollout manager calls. `chunks_per_engine` / `in_flight`: how finely a step is split and how
        many of its calls one engine may hold at once (see the module docstring); `calls_per_engine`: threads and
        connections for that many calls to one engine at once, from all steps in progress (default in_flight)."""
        from transformers import AutoTokenizer  # noqa: PLC0415 - transformers is heavy: loaded on use

        if not engine_urls:
            raise ValueError("the rollout manager needs at least one engine URL")
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.rows = load_rows(cfg.data.path, cfg.data.input_key, cfg.data.label_key, cfg.data.image_key)
        self.prompts = Prompts(cfg.model.path, cfg.data.image_key, self.tokenizer)
        self._batches = batches(self.rows, cfg.algorithm.rollout_batch_size, cfg.algorithm.seed)
        self.position = 0  # batches taken from self._batches (one per generated step)
        self.reward = reward_fn(cfg.data)
        self.urls = list(engine_urls)
        self.clients = [EngineClient(u, api_key=api_key, admin_api_key=admin_api_key, timeout=timeout_s,
                                     pool_size=max(in_flight, calls_per_engine or 1, 1) + 1) for u in engine_urls]
        self.lora_path = POLICY_ADAPTER if cfg.lora.effective_sync_mode is SyncMode.ADAPTER else None
        self.seeded = reproducible_rollouts(cfg)  # per-sample sampling_seed (see the module docstring)
        self.timeout_s, self.health_timeout_s = timeout_s, health_timeout_s
        self.chunks_per_engine, self.in_flight = max(chunks_per_engine, 1), max(in_flight, 1)
        self.load = _Load([0] * len(self.clients), [0] * len(self.clients))
        self._pool = ThreadPoolExecutor(len(self.clients) * (max(self.in_flight, calls_per_engine or 1) + 1),
                                        thread_name_prefix="rollout")
        self.rids = InFlightRids()  # prefixed rids per call in flight, for abort_prefix

    def skip_to(self, position: int) -> int:
        """Fast-forward the prompt iterator to `position` batches taken (a checkpoint's data position)."""
        if position < self.position:
            raise ValueError(f"cannot rewind the prompt iterator from batch {self.position} to {position}")
        while self.position < position:
            next(self._batches)
            self.position += 1
        return self.position

    def generate(self, step: int) -> tuple[RolloutBatch, dict[str, Any]]:
        t0 = time.monotonic()
        alg = self.cfg.algorithm
        rows = next(self._batches)
        self.position += 1
        prompts, images, image_data = self.prompts.build(rows)  # [N] token ids (a VL prompt's placeholders expanded)
        g = alg.n_samples_per_prompt
        ids, params = self.requests(prompts, g, alg.seed, step)
        outs, out_engines = self.spread(step, ids, params, g, image_data=image_data)
        gen_s = time.monotonic() - t0
        batch = self.scored(rows, prompts, outs, g, self.reward, [o.weight_version for o in outs], images)
        stats = {"gen_ms": round(gen_s * 1000, 1), "rollout_ms": round((time.monotonic() - t0) * 1000, 1),
                 "weight_versions": sorted({v or "" for v in batch.weight_versions}),
                 "data_position": self.position,  # batches taken up to and including this step's
                 "engine_requests": list(self.load.served),  # requests each engine answered, in engine_urls order
                 "engines_out": out_engines}  # url -> why it was taken out for this step
        return batch, stats

    def requests(self, prompts: list[list[int]], g: int, seed: int, step: int
                 ) -> tuple[list[list[int]], list[dict[str, Any]]]:
        """One request per sample, a prompt's g samples adjacent; a seed (when seeded) names the sample, not the
        engine or the chunk that carries it."""
        base = {"max_new_tokens": self.cfg.algorithm.max_new_tokens, "temperature": self.cfg.algorithm.temperature}
        ids = [prompts[i] for i in range(len(prompts)) for _ in range(g)]
        params = [{**base, "sampling_seed": sampling_seed(seed, step, i, j)} if self.seeded else base
                  for i in range(len(prompts)) for j in range(g)]
        return ids, params

    def scored(self, rows: list[Row], prompts: list[list[int]], outs: list[GenerateOutput], g: int,
               reward: RewardFn, versions: list[str | None], images: list[ImageInputs | None] | None = None
               ) -> RolloutBatch:
        """The step's samples as a batch, each scored by `reward` and tagged with its version (`images`: each
        prompt's, for a VL batch: a group's samples share them)."""
        batch = RolloutBatch([], [], [], [], g)
        if images is not None:
            batch.images = [images[k // g] for k in range(len(outs))]
        for k, out in enumerate(outs):
            row = rows[k // g]
            batch.prompt_ids.append(prompts[k // g])
            batch.response_ids.append(out.output_ids)
            batch.rollout_logprobs.append(out.output_logprobs)
            batch.weight_versions.append(versions[k])
            # decode of one sequence is a str (transformers types it str | list[str])
            response = out.text if out.text is not None else cast(str, self.tokenizer.decode(
                out.output_ids, skip_special_tokens=True))
            batch.rewards.append(float(reward(Sample(row.prompt, response, row.label, row.index))))
        return batch

    # ---- spreading a step over the engines ---------------------------------------------------------------

    def _chunks(self, ids: list[list[int]], params: list[dict[str, Any]], g: int, engines: int,
                image_data: list[list[str]] | None = None, most: int | None = None) -> list[_Chunk]:
        """The step's prompts in consecutive runs, about `chunks_per_engine` per engine (one call per engine when
        there is one: nothing to balance, and the engine batches the whole step), each at most `most` prompts
        when given; `image_data`: per prompt."""
        n_prompts = len(ids) // g
        per = -(-n_prompts // (engines * self.chunks_per_engine)) if engines > 1 else n_prompts
        per = min(per, most) if most else per
        return [_Chunk(ids[p * g:(p + per) * g], params[p * g:(p + per) * g],
                       None if image_data is None else [image_data[k // g] for k in range(p * g, (p + per) * g)
                                                        if k < len(ids)])
                for p in range(0, n_prompts, per)]

    def _health(self) -> dict[int, str]:
        """GET /health on every engine at once: those that fail it, with why."""
        futs = [self._pool.submit(c.health, self.health_timeout_s) for c in self.clients]
        return {e: f"GET /health failed within {self.health_timeout_s:g}s" for e, f in enumerate(futs)
                if not f.result()}

    def spread(self, step: int, ids: list[list[int]], params: list[dict[str, Any]], g: int,
               lora_path: str | None = None, rid_prefix: str | None = None,
               image_data: list[list[str]] | None = None, chunk_prompts: int | None = None,
               on_chunk: Callable[[int, list[GenerateOutput]], None] | None = None, in_flight: int | None = None,
               ) -> tuple[list[GenerateOutput], dict[str, str]]:
        """Every request answered, in order. Each call goes to the healthy engine holding the fewest requests
        that has room (`in_flight` calls); an engine that fails /health or a call is out for the step and its
        calls go to the others; a refused request (4xx) or no engine left fails the step. `lora_path`: the
        adapter (default: the job's, kora-policy in Adapter mode); `rid_prefix`: request ids
        `<rid_prefix><uuid>` (multi-LoRA: `<adapter>::`, so a retire finds them: abort_prefix); `image_data`:
        each prompt's images as SGLang's image_data items (wire/vision.py), for a VL model. `chunk_prompts`: at
        most this many prompts a call; `on_chunk(first prompt, outputs)`: told of each call's answers as they come
        (on the calling thread), so whole groups can move on before the step is done (multi-LoRA streaming);
        `in_flight`: calls of this step one engine may hold at once (default the manager's)."""
        lora_path = lora_path or self.lora_path
        down = self._health()
        alive = [e for e in range(len(self.clients)) if e not in down]
        if not alive:
            raise RolloutError(self._none_left(step, down))
        chunks = self._chunks(ids, params, g, len(alive), image_data, chunk_prompts)
        starts = list(accumulate((len(c.ids) // g for c in chunks), initial=0))  # each chunk's first prompt
        results: list[list[GenerateOutput] | None] = [None] * len(chunks)
        queue = deque(range(len(chunks)))
        running: dict[Future[list[GenerateOutput]], tuple[int, int]] = {}  # call -> (chunk, engine)
        calls = [0] * len(self.clients)
        self.load = load = _Load([0] * len(self.clients), [0] * len(self.clients), len(ids))
        # every call is bounded by the client's timeout; each chunk is tried at most once per engine
        deadline = time.monotonic() + self.timeout_s * len(self.clients) + self.health_timeout_s
        while queue or running:
            while queue:
                room = [e for e in alive if calls[e] < (in_flight or self.in_flight)]
                if not room:
                    break
                e = min(room, key=lambda i: (load.outstanding[i], i))
                c = queue.popleft()
                n = len(chunks[c].ids)
                calls[e] += 1
                load.outstanding[e] += n
                load.queued -= n
                running[self._pool.submit(self._generate, e, chunks[c], lora_path, rid_prefix)] = (c, e)
            done, _ = wait(running, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED)
            if not done:
                raise RolloutError(f"step {step}: {len(running)} /generate calls unanswered after "
                                   f"{self.timeout_s * len(self.clients):.0f}s")
            for fut in done:
                c, e = running.pop(fut)
                n = len(chunks[c].ids)
                calls[e] -= 1
                load.outstanding[e] -= n
                try:
                    results[c] = fut.result()
                except EngineError as err:
                    if 0 < err.status < 500:  # the request itself was refused: another engine would refuse it too
                        raise RolloutError(f"step {step}: engine {self.urls[e]} refused a request: {err}") from err
                    if e in alive:
                        alive.remove(e)
                        down[e] = str(err)
                    if not alive:
                        raise RolloutError(self._none_left(step, down)) from err
                    queue.appendleft(c)  # to the engines left
                    load.queued += n
                else:
                    load.served[e] += n
                    if on_chunk is not None:
                        on_chunk(starts[c], results[c] or [])
        return [out for chunk in results if chunk is not None for out in chunk], {
            self.urls[e]: why for e, why in sorted(down.items())}

    def _none_left(self, step: int, down: dict[int, str]) -> str:
        why = "; ".join(f"{self.urls[e]}: {reason}" for e, reason in sorted(down.items()))
        return f"step {step}: no rollout engine left ({why})"

    def _generate(self, e: int, chunk: _Chunk, lora_path: str | None,
                  rid_prefix: str | None) -> list[GenerateOutput]:
        """One engine's share; with `rid_prefix`, its rids held in `rids` while the call runs (a closed prefix:
        answered aborted without being sent)."""
        if rid_prefix is None:
            return self._call(self.clients[e], chunk, lora_path, None, None)
        rids = [f"{rid_prefix}{uuid.uuid4().hex}" for _ in chunk.ids]
        with self.rids.sent(rid_prefix, e, rids) as ok:
            if not ok:
                return [not_sent(rid_prefix) for _ in chunk.ids]
            return self._call(self.clients[e], chunk, lora_path, rids, rid_prefix)

    def _call(self, client: EngineClient, chunk: _Chunk, lora_path: str | None, rids: list[str] | None,
              rid_prefix: str | None) -> list[GenerateOutput]:
        """A colocated Adapter-mode sync replaces the adapter by unload + load (SGLang has no replace); a request
        that lands in between is refused, so retry a few times (bounded) — unless its prefix was closed meanwhile
        (the adapter retired and unloaded: answered aborted)."""
        for attempt in range(ADAPTER_SWAP_RETRIES + 1):
            try:
                return client.generate(chunk.ids, chunk.params, lora_path=lora_path, rid=rids,
                                       image_data=chunk.images)
            except EngineError as e:
                swapping = lora_path is not None and lora_path in e.message and e.status == 400
                if swapping and rid_prefix is not None and self.rids.is_closed(rid_prefix):
                    return [not_sent(rid_prefix) for _ in chunk.ids]
                if not swapping or attempt == ADAPTER_SWAP_RETRIES:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def abort_prefix(self, prefix: str, wait_s: float = ABORT_WAIT_S) -> dict[str, Any]:
        """Abort every request whose rid starts with `prefix`, each by its exact rid on the engine it went to
        (every build has that abort; a stock one has no prefix form), and send no more of them; waits (bounded)
        until every such call returned. {"aborted": rids aborted, "in_flight_left": per engine URL, "ms"}."""
        t0 = time.monotonic()
        held = self.rids.close(prefix)
        aborted = sum(len(r) for r in held.values())
        while held:
            for e, rids in held.items():
                for rid in rids:
                    # an engine that cannot answer fails its call, which then returns anyway
                    with contextlib.suppress(EngineError):
                        self.clients[e].abort_request(rid)
            if time.monotonic() - t0 > wait_s:
                break
            # polling this manager's own registry, bounded by wait_s: an abort that reached the engine before
            # its /generate did was dropped there (a rid it did not yet track), so those still held get it again
            time.sleep(ABORT_REPEAT_S)
            held = self.rids.held(prefix)
        return {"aborted": aborted, "in_flight_left": {u: len(held.get(e, [])) for e, u in enumerate(self.urls)},
                "ms": round((time.monotonic() - t0) * 1000, 1)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()


def not_sent(rid_prefix: str) -> GenerateOutput:
    """The answer of a request not sent because its rid prefix was closed (its adapter is retiring): aborted,
    as SGLang answers a request aborted before it ran."""
    reason = {"type": "abort", "message": f"not sent: {rid_prefix} is retiring", "status_code": None,
              "err_type": None}
    return GenerateOutput(None, [], [], reason, None, 0, {"finish_reason": reason})
