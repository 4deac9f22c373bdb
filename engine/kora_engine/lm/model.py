"""The model side of the reference engine: an HF causal LM, its adapters, batched KV-cached
generation, and in-place weight updates (full weights, or LoRA pairs folded into a pristine base).

Concurrency (the HTTP layer calls these from worker threads):
- `lock` is held by a generate call while it runs and by every weight write (`writing()`, or
  `begin_write()` / `end_write()` around a write made by another process: the colocated fast path).
  A write waits for at most one forward step, not for the generation in flight: a waiting writer
  makes every generation give the lock up at its next step boundary and wait until no writer is
  left, then recompute its KV cache under the new weights (as `retract` does), so no forward ever
  reads a half-written weight and every token after the write comes from the new weights. A
  rollout that spanned a write reports the weight version it STARTED under (the oldest that served
  it: the trainer then never takes it for on-policy). A generation paused with mode
  `in_place`/`retract` releases the lock while paused (SGLANG_API.md §4), and `retract`
  recomputes the KV cache on resume.
- Adapters are immutable objects in a dict; a request resolves its adapter once, at admission,
  so an upsert under the same name lets in-flight requests finish on the old adapter.
- Nothing here is needed to answer `/model_info` or `/health` while an update runs.
"""

from __future__ import annotations

import inspect
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from kora_engine.lm.lora_adapters import LoRAAdapter, MultiLoRAHooks
from kora_engine.lm.param_lora import ROUTER_MERGE_REFUSED, ParamTarget, folded, resolve_target
from kora_engine.lm.sampling import (
    SamplingParams,
    apply_penalties,
    check_stop,
    needs_processing,
    sample_rows,
)
from kora_trainer.hf_experts import fused_parent, fused_slot
from kora_trainer.kernels.fold import FoldItem, GroupedFold, fold
from kora_trainer.wire.vision import (
    ImageInputs,
    VisionTokens,
    decode_image_item,
    decode_positions,
    forward_inputs,
    is_vision_language,
    load_image_processor,
    load_policy_model,
    process_images,
)

DEFAULT_WEIGHT_VERSION = "default"  # SGLang's ServerArgs.weight_version default


def aborted_by_request() -> dict[str, Any]:
    """What SGLang reports for a request ended by /abort_request: the scheduler sets `FINISH_ABORT()` on it
    (schedule_batch.py: message defaults to "Aborted", no status code) and the partial output is returned, 200."""
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@dataclass
class GenRequest:
    """One sequence to generate (a prompt expanded by `n` gives n of these)."""

    input_ids: list[int]
    params: SamplingParams
    adapter: LoRAAdapter | None = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    images: ImageInputs | None = None  # a VL prompt's images (its input_ids hold their expanded placeholders)
    aborted: bool = field(default=False, compare=False)  # set by /abort_request (inflight.py); read per step


@dataclass
class GenResult:
    request: GenRequest
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)  # for input positions [start, L)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    text: str = ""
    weight_version: str | None = None
    started_under: str | None = None  # the server's weight version when this row's generation started
    spanned_write: bool = False  # a weight write landed while it ran (the version it reports is started_under)
    num_retractions: int = 0
    started: float = field(default_factory=time.monotonic)
    latency: float = 0.0


class GenerationControl:
    """`/pause_generation` and `/continue_generation` state shared by all generate calls."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.paused = False
        self.mode = "abort"
        self.abort_epoch = 0
        self.active = 0  # generate calls admitted and not finished

    def pause(self, mode: str) -> None:
        with self.cond:
            self.paused, self.mode = True, mode
            if mode == "abort":
                self.abort_epoch += 1
            self.cond.notify_all()

    def abort_all(self) -> None:
        """`abort_all_requests`: in-flight generations end with finish_reason abort at their next step."""
        with self.cond:
            self.abort_epoch += 1
            self.cond.notify_all()

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.active == 0, timeout=timeout)

    def admit(self) -> int:
        """Block while paused (new requests queue, as in SGLang); returns the abort epoch seen."""
        with self.cond:
            self.cond.wait_for(lambda: not self.paused)
            self.active += 1
            return self.abort_epoch

    def release(self) -> None:
        with self.cond:
            self.active -= 1
            self.cond.notify_all()


def _dtype(name: str, config_dtype: Any) -> torch.dtype:
    if name == "auto":
        return config_dtype if isinstance(config_dtype, torch.dtype) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class EngineModel:
    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "auto", max_loras_per_batch: int = 8,
                 max_lora_rank: int | None = None):
        from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415 - transformers is heavy: loaded on use

        self.model_path = model_path
        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(model_path)
        self.dtype = _dtype(dtype, getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
        # a VL checkpoint loads with its vision tower (the class the trainer loads: wire/vision.py)
        self.model: nn.Module = load_policy_model(model_path, dtype=self.dtype).to(self.device)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.config = self.model.config
        self.vision_tokens = VisionTokens.of(self.config) if is_vision_language(self.config) else None
        self.image_processor = load_image_processor(model_path) if self.vision_tokens else None
        text_config = getattr(self.config, "text_config", None) or self.config  # a VL config nests the LM's
        self.max_context = int(getattr(text_config, "max_position_embeddings", 1 << 30))
        # the ids the embedding can look up (SGLang checks model_config.vocab_size, the same number for HF models)
        self.vocab_size = int(cast(Any, self.model).get_input_embeddings().weight.shape[0])
        self.max_loras_per_batch = max_loras_per_batch
        self.max_lora_rank = max_lora_rank
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = self._eos_ids()
        self.lock = threading.Lock()
        self._writers = 0  # weight writes waiting for or holding `lock`
        self._write_cond = threading.Condition()
        self.control = GenerationControl()
        self.hooks = MultiLoRAHooks(self.model)
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self._params: dict[str, nn.Parameter] = dict(self.model.named_parameters(remove_duplicate=False))
        # transformers 5.x renames `past_key_values` to `cache` (the old name is deprecated)
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_args else "past_key_values"
        self._keep_kw = "logits_to_keep" in forward_args
        self._pristine: dict[str, torch.Tensor] = {}  # base W0 of weights a lora_merge has changed
        self._pristine_dropped = 0  # how many times a base was dropped (a PlannedMerge over older bases re-plans)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.config, getattr(self.model, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else list(eos or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- weight writers (see the module docstring) -----------------------------------------

    def begin_write(self) -> None:
        """Take `lock` for a weight write: generation in flight gives it up at its next step boundary."""
        with self._write_cond:
            self._writers += 1
        try:
            self.lock.acquire()
        except BaseException:
            self._writer_done()
            raise

    def try_begin_write(self) -> bool:
        """Take `lock` for a weight write only when nothing holds it (no generation in flight, no other write):
        False, and nothing taken, otherwise."""
        with self._write_cond:
            self._writers += 1
        if self.lock.acquire(blocking=False):
            return True
        self._writer_done()
        return False

    def end_write(self) -> None:
        self.lock.release()
        self._writer_done()

    def _writer_done(self) -> None:
        with self._write_cond:
            self._writers -= 1
            self._write_cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        self.begin_write()
        try:
            yield
        finally:
            self.end_write()

    def _yield_to_writers(self, results: list[GenResult]) -> bool:
        """At a step boundary: if a write waits, let it (and any queued behind it) in; True if one ran."""
        if not self._writers:  # read unlocked: a writer arriving now is seen at the next step
            return False
        self.lock.release()
        with self._write_cond:
            self._write_cond.wait_for(lambda: self._writers == 0)
        self.lock.acquire()
        for res in results:
            res.spanned_write = True
        return True

    # ---- generation -------------------------------------------------------------------------

    def generate(self, requests: list[GenRequest], admit: bool = True) -> list[GenResult]:
        """Run every request; sub-batches hold at most max_loras_per_batch distinct adapters (base counts).

        admit=False (the health probe) skips the pause gate and the in-flight count.
        """
        if not admit:
            with self.lock:
                probe = [GenResult(r) for r in requests]
                self._run_batch(probe, self.control.abort_epoch)
                return probe
        epoch = self.control.admit()
        try:
            with self.lock:
                results: list[GenResult] = [GenResult(r) for r in requests]
                for chunk in self._chunks(requests):
                    self._run_batch([results[i] for i in chunk], epoch)
                return results
        finally:
            self.control.release()

    def _chunks(self, requests: list[GenRequest]) -> list[list[int]]:
        chunks: list[list[int]] = []
        keys: list[set[int]] = []
        for i, r in enumerate(requests):
            key = id(r.adapter) if r.adapter is not None else 0
            for chunk, seen in zip(chunks, keys, strict=True):
                if key in seen or len(seen) < self.max_loras_per_batch:
                    chunk.append(i)
                    seen.add(key)
                    break
            else:
                chunks.append([i])
                keys.append({key})
        return chunks

    def image_inputs(self, items: list[Any]) -> ImageInputs:
        """One prompt's image_data items -> what the vision tower takes (ValueError naming image_data otherwise)."""
        if self.image_processor is None:
            raise ValueError("image_data: this engine's model has no vision tower")
        return process_images(self.image_processor, [decode_image_item(x) for x in items])

    def _forward(self, ids: torch.Tensor | None, mask: torch.Tensor, pos: torch.Tensor, cache: Any,
                 last_only: bool = True, **extra: Any) -> torch.Tensor:
        """`ids` None: `extra` holds inputs_embeds (a VL prefill's, the image features in)."""
        kwargs: dict[str, Any] = {self._cache_kw: cache, "position_ids": pos, **extra}
        if ids is not None:
            kwargs["input_ids"] = ids
        if last_only and self._keep_kw:
            kwargs["logits_to_keep"] = 1  # the lm_head for the last position only
        out = self.model(attention_mask=mask, use_cache=True, **kwargs)
        return cast(torch.Tensor, out.logits)  # [B, T, V]

    def _prefill(self, seq: torch.Tensor, mask: torch.Tensor, all_logits: bool = False,
                 images: list[ImageInputs | None] | None = None, prompt_width: int = 0
                 ) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        """A fresh KV cache over seq [B, T] (left-padded prompts in columns < prompt_width, then generated tokens);
        logits [B, T, V] (all_logits) or [B, 1, V]; for a VL model the rope deltas [B, 1] its decode steps continue
        from (else None)."""
        from transformers import DynamicCache  # noqa: PLC0415 - transformers is heavy: loaded on use

        # per layer type: a GDN layer keeps its conv / recurrent state
        cache = DynamicCache(config=getattr(self.model, "config", None))
        if self.vision_tokens is not None:  # multimodal RoPE, the images through the tower (wire/vision.py)
            kwargs, deltas = forward_inputs(self.model, seq, mask, images or [None] * seq.shape[0],
                                            self.vision_tokens.image, [prompt_width or seq.shape[1]] * seq.shape[0])
            pos, ids = kwargs.pop("position_ids"), kwargs.pop("input_ids", None)
            return cache, self._forward(ids, mask, pos, cache, last_only=not all_logits, **kwargs), deltas
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]: left padding keeps real positions 0..len-1
        return cache, self._forward(seq, mask, pos, cache, last_only=not all_logits), None

    def _left_padded(self, lens: list[int], reqs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts left-padded into seq [B, L] and its attention mask [B, L]."""
        b, width = len(reqs), max(lens)
        for n in lens:
            if n >= self.max_context:
                raise ValueError(f"The input ({n} tokens) is longer than the model's context length "
                                 f"({self.max_context} tokens).")
        seq = torch.full((b, width), self.pad_id, dtype=torch.long, device=self.device)  # [B, L] left-padded
        mask = torch.zeros((b, width), dtype=torch.long, device=self.device)  # [B, L]
        for i, r in enumerate(reqs):
            seq[i, width - lens[i]:] = torch.tensor(r.input_ids, dtype=torch.long)
            mask[i, width - lens[i]:] = 1
        return seq, mask

    @staticmethod
    def _abort(results: list[GenResult], active: list[bool]) -> None:
        for i, res in enumerate(results):
            if active[i]:
                active[i] = False
                res.finish_reason = {"type": "abort", "message": "Abort all requests.",
                                     "status_code": None, "err_type": None}

    @torch.no_grad()
    def _run_batch(self, results: list[GenResult], epoch: int) -> None:
        for res in results:
            res.started_under = self.weight_version
        reqs = [r.request for r in results]
        b = len(reqs)
        lens = [len(r.input_ids) for r in reqs]
        width = max(lens)
        seq, mask = self._left_padded(lens, reqs)
        adapters = [r.adapter for r in reqs]
        images = [r.images for r in reqs]
        want_input = any(r.return_logprob and r.logprob_start_len >= 0 for r in reqs)
        with self.hooks.rows(adapters, self.device):
            cache, logits, deltas = self._prefill(seq, mask, want_input, images, width)  # [B, L or 1, V]
        if want_input:
            for i, res in enumerate(results):
                self._input_logprobs(res, logits[i, width - lens[i]:], lens[i])
        next_logits = logits[:, -1, :].float()  # [B, V]
        active = [True] * b
        for i, res in enumerate(results):
            if res.request.params.max_new_tokens == 0:
                active[i] = False
                res.finish_reason = {"type": "length", "length": 0}
        step = 0
        while any(active):
            if self.control.abort_epoch != epoch:
                self._abort(results, active)
                break
            for i in range(b):  # /abort_request: only the rows it named end; the others go on
                if active[i] and reqs[i].aborted:
                    active[i] = False
                    results[i].finish_reason = aborted_by_request()
            if not any(active):
                break
            raw = torch.log_softmax(next_logits, dim=-1).cpu()  # [B, V] raw model log-probs (no temperature)
            rows = [i for i in range(b) if active[i]]
            toks = sample_rows(self._processed(results, rows, next_logits), [reqs[i].params for i in rows],
                               [lens[i] + step for i in rows])
            chosen = torch.full((b, 1), self.pad_id, dtype=torch.long)
            for i, tok in zip(rows, toks, strict=True):
                chosen[i, 0] = tok
                self._record(results[i], raw[i], tok)
                active[i] = self._still_running(results[i], lens[i])
            chosen = chosen.to(self.device)
            if not any(active):
                break
            seq = torch.cat([seq, chosen], dim=1)  # [B, L+t+1]
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
            step += 1
            # retract, or a weight write let in: the KV cache is dropped and recomputed under today's weights
            if self._pause_point(results) or self._yield_to_writers(results):
                with self.hooks.rows(adapters, self.device):
                    cache, logits, deltas = self._prefill(seq, mask, images=images, prompt_width=width)
                next_logits = logits[:, -1, :].float()
                continue
            pos = self._step_positions(mask, deltas)
            with self.hooks.rows(adapters, self.device):
                next_logits = self._forward(chosen, mask, pos, cache)[:, -1, :].float()
        for res in results:
            self._finish(res)

    @staticmethod
    def _step_positions(mask: torch.Tensor, deltas: torch.Tensor | None) -> torch.Tensor:
        """A decode step's positions: [B, 1], or [4, B, 1] for a VL model (its rope deltas: wire/vision.py)."""
        pos = mask.sum(-1, keepdim=True) - 1  # [B, 1]
        return pos if deltas is None else decode_positions(pos, deltas)

    def _pause_point(self, results: list[GenResult]) -> bool:
        """While paused in place / retract: let weight updates in (release the lock) until continued."""
        control = self.control
        with control.cond:
            if not control.paused or control.mode == "abort":
                return False
            mode = control.mode
            self.lock.release()
            control.cond.wait_for(lambda: not control.paused)
        self.lock.acquire()
        if mode == "retract":
            for res in results:
                res.num_retractions += 1
            return True
        return False

    def _processed(self, results: list[GenResult], rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> [len(rows), V] on CPU, with each row's bias / penalties / min_new_tokens mask."""
        out = logits[rows].float().cpu()  # [R, V]
        for j, i in enumerate(rows):
            res = results[i]
            p = res.request.params
            if needs_processing(p, len(res.output_ids)):
                stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
                out[j] = apply_penalties(out[j].clone(), p, res.output_ids, len(res.output_ids), stop_ids)
        return out

    def _record(self, res: GenResult, raw: torch.Tensor, tok: int) -> None:
        res.output_ids.append(tok)
        req = res.request
        if req.return_logprob:
            res.output_logprobs.append(float(raw[tok]))
            if req.top_logprobs_num > 0:
                top = torch.topk(raw, min(req.top_logprobs_num, raw.numel()))
                res.output_top.append(list(zip(top.values.tolist(), top.indices.tolist(), strict=True)))

    def _still_running(self, res: GenResult, prompt_len: int) -> bool:
        p = res.request.params
        text = str(self.tokenizer.decode(res.output_ids, skip_special_tokens=p.skip_special_tokens)) \
            if (p.stop or p.stop_regex) else ""
        stop = check_stop(p, res.output_ids, text, self.eos_ids, self.max_context - prompt_len - len(res.output_ids))
        if stop.finish_reason is None:
            return True
        res.finish_reason = stop.finish_reason
        if stop.trim_to is not None:
            res.text = text[: stop.trim_to]
        return False

    def _input_logprobs(self, res: GenResult, logits: torch.Tensor, n: int) -> None:
        """logits [n, V] of the prompt's own positions; entry j is log p(token j | tokens < j)."""
        req = res.request
        if not req.return_logprob or req.logprob_start_len < 0:
            return
        start = min(req.logprob_start_len, n - 1)
        lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
        ids = req.input_ids
        for j in range(start, n):
            if j == 0:
                res.input_logprobs.append(None)
                res.input_top.append(None)
                continue
            res.input_logprobs.append(float(lp[j - 1, ids[j]]))
            if req.top_logprobs_num > 0:
                top = torch.topk(lp[j - 1], min(req.top_logprobs_num, lp.shape[-1]))
                res.input_top.append(list(zip(top.values.tolist(), top.indices.tolist(), strict=True)))

    def _finish(self, res: GenResult) -> None:
        p = res.request.params
        if not res.text:
            res.text = str(self.tokenizer.decode(res.output_ids, skip_special_tokens=p.skip_special_tokens))
        adapter = res.request.adapter
        if adapter is not None and adapter.version:
            res.weight_version = adapter.version  # the adapter object it was admitted with: never rewritten
        else:
            res.weight_version = res.started_under if res.spanned_write else self.weight_version
        res.latency = time.monotonic() - res.started

    def decode_token(self, tok: int) -> str:
        return str(self.tokenizer.decode([tok]))

    # ---- weights -----------------------------------------------------------------------------

    def _param(self, name: str) -> torch.Tensor:
        p = self._params.get(name)
        if p is None:
            raise ValueError(f"the model has no weight named {name}")
        return p

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Full-weight update: copy each tensor in; it becomes the new pristine base for lora_merge. A fused MoE
        expert parameter takes its experts one by one (`…experts.{e}.gate_proj.weight`, …: hf_experts.py)."""
        with self.writing(), torch.no_grad():
            for name, tensor in named:
                if name not in self._params and name.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer HF checkpoints sometimes carry; SGLang skips it too
                # per-expert names (checkpoints', SGLang's, what kora pushes) land in transformers 5's fused experts
                slot = fused_slot(name, self._params) if name not in self._params else None
                p = slot if slot is not None else self._param(name)
                if tuple(p.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(p.shape)}")
                p.copy_(tensor.to(device=p.device, dtype=p.dtype))
                self._drop_pristine(name)

    def weights_replaced(self, names: list[str]) -> None:
        """Full weights a caller wrote in place (kora's fast sync, inside `writing()`): the new pristine base for
        lora_merge, as after `load_weights`."""
        for name in names:
            self._drop_pristine(name)

    def _drop_pristine(self, name: str) -> None:
        if self._pristine.pop(fused_parent(name) or name, None) is not None:
            self._pristine_dropped += 1

    def _merge_targets(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int
                       ) -> dict[str, ParamTarget]:
        """The parameter each pair folds into, every pair checked before any weight changes (a router pair is
        refused: SPEC rule 5)."""
        modules = dict(self.model.named_modules())
        targets = {key: resolve_target(modules, key, a, b, None) for key, (a, b) in pairs.items()}
        for key, t in targets.items():
            if t.router:
                raise ValueError(ROUTER_MERGE_REFUSED.format(module=t.module))
            if t.rank(pairs[key][0]) != rank:
                raise ValueError(f"{key}: lora_A has rank {t.rank(pairs[key][0])}, the request says lora_rank {rank}")
        return targets

    def _pristine_of(self, name: str, p: torch.Tensor) -> torch.Tensor:
        w0 = self._pristine.get(name)
        if w0 is None:
            w0 = self._pristine[name] = p.detach().clone()
        return w0

    def planned_merge(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float, rank: int,
                      fp32: bool) -> PlannedMerge:
        """`merge_lora` of pairs that stay where they are between calls (the colocated ring's slot), planned once.
        On a GPU (2-D weights, merge_fp32) each call is one replay of the fused folds captured in a CUDA graph
        (kernels/fold.GroupedFold: the kernel and numbers of `merge_lora` there); elsewhere it is `merge_lora`."""
        targets = self._merge_targets(pairs, rank)
        if not fp32 or any(t.experts or t.transposed or not self._param(t.name).is_cuda for t in targets.values()):
            return PlannedMerge(self, lambda: self._fold_pairs(targets, pairs, alpha / rank, fp32), {})
        with torch.no_grad():
            bases = {t.name: self._pristine_of(t.name, self._param(t.name)) for t in targets.values()}
            fold = GroupedFold([FoldItem(bases[t.name], self._param(t.name).data, pairs[k][0], pairs[k][1],
                                         alpha / rank) for k, t in targets.items()])

        def replay() -> None:
            with torch.no_grad():
                fold()

        return PlannedMerge(self, replay, bases)

    def merge_lora(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float, rank: int,
                   fp32: bool) -> None:
        """W = W0 + (alpha/rank)·ΔW for each pair, from the pristine W0 (so merges never accumulate): B·A into a
        Linear's weight, B_e·A_e into expert e of a fused 3-D expert parameter (PEFT's grouped layout).

        With fp32 the sum is formed in float32 and rounded to the weight dtype once. Every pair is checked
        before any weight changes; a router pair is refused (SPEC rule 5).
        """
        targets = self._merge_targets(pairs, rank)
        with self.writing():
            self._fold_pairs(targets, pairs, alpha / rank, fp32)

    @torch.no_grad()
    def _fold_pairs(self, targets: dict[str, ParamTarget], pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                    scale: float, fp32: bool) -> None:
        """`merge_lora`'s fold of checked pairs; the caller holds the weight lock."""
        for key, t in targets.items():
            a, b = pairs[key]
            p = self._param(t.name)
            w0 = self._pristine_of(t.name, p)
            if fp32 and p.is_cuda and not t.experts and not t.transposed:
                # the fused fold (kernels/fold.py): W0 read once, W written once, fp32 accumulation rounded
                # once; the torch expression below makes W0 and B·A in fp32 first (several passes over W)
                fold(w0, a.to(p.device), b.to(p.device), scale, out=p.data)
            else:
                p.copy_(folded(w0, a, b, scale, t, torch.float32 if fp32 else p.dtype))


class PlannedMerge:
    """`EngineModel.planned_merge`'s answer: call it to fold the pairs again (it takes the weight lock), or call
    `run()` inside the caller's own `writing()` (the fold is enqueued: on a GPU synchronise before the weights
    count as written). It holds the pristine bases it was planned over; when a full-weight write has replaced
    one since (`weights_replaced`), `current()` is False and the caller plans again."""

    def __init__(self, engine: EngineModel, run: Callable[[], None], bases: dict[str, torch.Tensor]):
        self.engine, self.run, self.bases = engine, run, bases
        self.dropped = engine._pristine_dropped

    def current(self) -> bool:
        """No base dropped since the plan (one comparison per push: a push's host time is on its critical path)."""
        return self.engine._pristine_dropped == self.dropped

    def __call__(self) -> None:
        with self.engine.writing():
            self.run()


@dataclass
class _Call:
    requests: list[GenRequest]
    results: list[GenResult] | None = None
    error: BaseException | None = None


class CallBatcher:
    """Merges /generate calls that wait for the engine into one forward batch.

    SGLang batches across requests continuously; this is the simple form: while one batch runs, the
    calls that arrive queue up, and the next thread to get the engine runs all of them together. A
    trainer that sends a rollout batch as many concurrent calls thus still gets batched forwards.
    Requests are validated before they queue, so one call's bad input cannot fail another call.
    """

    def __init__(self, engine: EngineModel):
        self.engine = engine
        self._pending: list[_Call] = []
        self._pending_lock = threading.Lock()
        self._leader = threading.Lock()  # one merged batch at a time; the rest queue here

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        call = _Call(requests)
        with self._pending_lock:
            self._pending.append(call)
        with self._leader:
            if call.results is None and call.error is None:
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                try:
                    results = self.engine.generate([r for c in batch for r in c.requests])
                except BaseException as e:  # every merged call sees the failure
                    for c in batch:
                        c.error = e
                else:
                    start = 0
                    for c in batch:
                        c.results = results[start:start + len(c.requests)]
                        start += len(c.requests)
        if call.error is not None:
            raise call.error
        assert call.results is not None
        return call.results
