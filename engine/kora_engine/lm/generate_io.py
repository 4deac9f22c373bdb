"""`/generate` bodies in and out, in SGLang's shapes (sglang 0.5.23 `GenerateReqInput`, IO:176, and
the response built in `TokenizerManager._handle_batch_output`, TM:2480).

In: `text` or `input_ids` (one prompt, or a list = a batch), `sampling_params` (one dict for all,
or one per prompt), `n` samples per prompt (the n samples of prompt i are adjacent in the
response), per-prompt or shared `return_logprob` / `logprob_start_len` / `top_logprobs_num`,
`lora_path` (an adapter *name*; a list gives one per prompt, null = base model), `rid`, and for a
vision-language model `image_data` (io_struct.py `GenerateReqInput.image_data`: one image or a list for a single
prompt, one entry per prompt for a batch, each an image or a list of images; base64 only here: wire/vision.py).

Out: one object for a single prompt with n = 1, else a list in input order:
`{"text", "output_ids", "meta_info": {id, finish_reason, prompt_tokens, completion_tokens,
cached_tokens, reasoning_tokens, weight_version, num_retractions, e2e_latency,
[input|output]_token_logprobs: [[logprob, token_id, text|null], ...], ...}}`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kora_engine.lm.lora_adapters import LoRAAdapter
from kora_engine.lm.model import GenRequest, GenResult
from kora_engine.lm.request_bodies import GenerateReqInput, parse
from kora_engine.lm.sampling import SamplingParams
from kora_trainer.wire.vision import ImageInputs, VisionTokens, expand_placeholders

ImagesOf = Callable[[list[Any]], ImageInputs]  # image_data items of one prompt -> what the vision tower takes


@dataclass
class ParsedGenerate:
    requests: list[GenRequest]
    single: bool  # answer with one object instead of a list
    return_prompt_token_ids: bool
    stream: bool


@dataclass(frozen=True)
class GenerateLimits:
    """What one `/generate` call may ask of this engine; past them it is a 400 naming the field.

    `vocab_size` and `context_len` are the model's (SGLang: `model_config.vocab_size`, `context_len` =
    max_position_embeddings); `max_sequences` (kora's own, `--max-sequences-per-call`) bounds prompts x n, so one
    body cannot make the engine build a billion requests (SGLang has no such bound)."""

    vocab_size: int
    context_len: int
    max_sequences: int


def _per_item(value: Any, i: int, default: Any) -> Any:
    if isinstance(value, list):
        return value[i] if i < len(value) and value[i] is not None else default
    return default if value is None else value


def _shown(ids: list[int]) -> str:
    """ids as SGLang prints them in its message, cut short past 32 (the body may hold thousands)."""
    return str(ids) if len(ids) <= 32 else f"[{', '.join(map(str, ids[:32]))}, ...] ({len(ids)} ids)"


def _check_prompt(ids: list[int], max_new_tokens: Any, limits: GenerateLimits) -> None:
    """SGLang's checks of one prompt (TokenizerManager `_validate_input_ids_in_vocab`, `_validate_one_request`):
    every id in the vocabulary, the prompt shorter than the context, prompt + an explicit max_new_tokens within it."""
    if not ids:
        raise ValueError("input_ids cannot be empty.")
    vocab = limits.vocab_size
    if any(i >= vocab for i in ids):
        raise ValueError(f"The input_ids {_shown(ids)} contains values greater than the vocab size ({vocab}).")
    if any(i < 0 for i in ids):  # SGLang 0.5.23 checks only the upper end; a negative id indexes nothing
        raise ValueError(f"The input_ids {_shown(ids)} contains negative values: token ids are in [0, {vocab}).")
    n, context = len(ids), limits.context_len
    if n >= context:
        raise ValueError(f"The input ({n} tokens) is longer than the model's context length ({context} tokens).")
    if max_new_tokens is not None and max_new_tokens + n > context:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested a "
            f"total of {max_new_tokens + n} tokens: {n} tokens from the input messages and {max_new_tokens} tokens "
            "for the completion. Please reduce the number of tokens in the input messages or the completion to fit "
            "within the limit.")


def _count_check(count: int, what: str, limits: GenerateLimits) -> None:
    if count > limits.max_sequences:
        raise ValueError(f"{what} make {count} sequences in one call; this engine takes at most "
                         f"{limits.max_sequences} (--max-sequences-per-call): split the batch")


def _prompts(body: dict[str, Any], tokenize: Callable[[str], list[int]],
             limits: GenerateLimits) -> tuple[list[list[int]], bool]:
    """(the prompts' token ids, batched), counted against the limit before anything is tokenized."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise ValueError("input_embeds is not supported by kora's hf engine")
    if text is None and input_ids is None:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:  # text wins when both are sent
        batched = isinstance(text, list)
        texts = text if batched else [text]
        _count_check(len(texts), f"{len(texts)} prompts", limits)
        if not text:  # SGLang's `_tokenize_texts`; a prompt that tokenizes to nothing is refused by _check_prompt
            raise ValueError("texts cannot be empty and tokenizer must be initialized")
        try:
            return [list(tokenize(t)) for t in texts], batched
        except Exception as e:  # e.g. a lone surrogate (\ud800): valid JSON, no valid text
            raise ValueError(f"text could not be tokenized ({type(e).__name__}: {e}): send valid Unicode text") \
                from None
    assert input_ids is not None
    if input_ids == []:
        raise ValueError("input_ids cannot be empty.")
    batched = isinstance(input_ids[0], list)
    prompts = [list(p) for p in (input_ids if batched else [input_ids])]
    _count_check(len(prompts), f"{len(prompts)} prompts", limits)
    return prompts, batched


def _sampling(body: dict[str, Any], n_prompts: int, limits: GenerateLimits) -> tuple[list[SamplingParams], list[Any]]:
    """(one SamplingParams per prompt, the max_new_tokens each prompt's dict names explicitly or None)."""
    raw_sp = body.get("sampling_params")
    if isinstance(raw_sp, list):
        if len(raw_sp) != n_prompts:
            raise ValueError(f"sampling_params has {len(raw_sp)} entries for a batch of {n_prompts} prompts.")
        params = [SamplingParams.from_json(sp, limits.vocab_size) for sp in raw_sp]
        if len({p.n for p in params}) > 1:
            raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
        explicit = [(sp or {}).get("max_new_tokens") for sp in raw_sp]
    else:
        params = [SamplingParams.from_json(raw_sp, limits.vocab_size)] * n_prompts
        explicit = [(raw_sp or {}).get("max_new_tokens")] * n_prompts
    return params, explicit


def _per_prompt_images(image_data: Any, n_prompts: int, batched: bool) -> list[list[Any]]:
    """SGLang's image_data shapes -> the items of each prompt (MultimodalDataInputFormat: an item, a list of items,
    or a list of lists)."""
    if not batched:
        return [list(image_data) if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != n_prompts:
        raise ValueError(f"image_data: a batch of {n_prompts} prompts takes a list of {n_prompts} entries (an "
                         "image, a list of images, or null per prompt)")
    return [[] if d is None else list(d) if isinstance(d, list) else [d] for d in image_data]


def _images(body: dict[str, Any], prompts: list[list[int]], batched: bool, images_of: ImagesOf | None,
            tokens: VisionTokens | None) -> list[ImageInputs | None]:
    """Each prompt's images (None: none), its input_ids' placeholders expanded in place to their token counts."""
    image_data = body.get("image_data")
    if image_data is None or image_data == []:
        return [None] * len(prompts)
    if images_of is None or tokens is None:
        raise ValueError("image_data: this engine's model has no vision tower (its config.json has no "
                         "vision_config): send text-only prompts, or serve a vision-language model")
    out: list[ImageInputs | None] = []
    for i, items in enumerate(_per_prompt_images(image_data, len(prompts), batched)):
        if not items:
            out.append(None)
            continue
        images = images_of(items)
        prompts[i][:] = expand_placeholders(prompts[i], tokens, images.tokens(tokens.merge))
        out.append(images)
    return out


def parse_generate(body: dict[str, Any], tokenize: Callable[[str], list[int]],
                   resolve_adapter: Callable[[str | None], LoRAAdapter | None],
                   limits: GenerateLimits, images_of: ImagesOf | None = None,
                   vision_tokens: VisionTokens | None = None) -> ParsedGenerate:
    """Raises ValueError with SGLang's messages; the contract gate has already checked JSON types. `images_of` /
    `vision_tokens`: a VL model's image processing and special tokens (None: image_data is refused)."""
    prompts, batched = _prompts(body, tokenize, limits)
    images = _images(body, prompts, batched, images_of, vision_tokens)
    params, explicit = _sampling(body, len(prompts), limits)
    n = params[0].n if params else 1
    _count_check(len(prompts) * n, f"{len(prompts)} prompts x n={n}", limits)
    for prompt, max_new in zip(prompts, explicit, strict=True):
        _check_prompt(prompt, max_new, limits)

    fields = parse(GenerateReqInput, body)  # BadRequest (SGLang's 400) for a mistyped one
    lora_path, rid = fields.lora_path, fields.rid
    requests: list[GenRequest] = []
    for i, prompt in enumerate(prompts):
        adapter = resolve_adapter(_per_item(lora_path, i, None))
        base_rid: str | None = None  # SGLang: one string for a batch becomes f"{rid}_{i}"
        if isinstance(rid, list):
            base_rid = rid[i] if i < len(rid) else None
        elif rid is not None:
            base_rid = f"{rid}_{i}" if batched else rid
        for j in range(n):
            requests.append(GenRequest(
                input_ids=prompt, params=params[i], adapter=adapter, images=images[i],
                rid=(base_rid if n == 1 else f"{base_rid}_{j}") if base_rid else uuid.uuid4().hex,
                return_logprob=bool(_per_item(body.get("return_logprob"), i, False)),
                logprob_start_len=int(_per_item(body.get("logprob_start_len"), i, -1)),
                top_logprobs_num=int(_per_item(body.get("top_logprobs_num"), i, 0)),
                return_text_in_logprobs=bool(body.get("return_text_in_logprobs") or False),
            ))
    return ParsedGenerate(requests, single=not batched and n == 1,
                          return_prompt_token_ids=bool(body.get("return_prompt_token_ids")),
                          stream=bool(body.get("stream")))


def _entries(pairs: Sequence[tuple[float | None, int]], with_text: bool,
             decode: Callable[[int], str]) -> list[list[Any]]:
    return [[lp, tok, decode(tok) if with_text else None] for lp, tok in pairs]


def format_result(res: GenResult, return_prompt_token_ids: bool, decode: Callable[[int], str]) -> dict[str, Any]:
    req = res.request
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": res.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(res.output_ids),
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "weight_version": res.weight_version,
        "num_retractions": res.num_retractions,
        "e2e_latency": res.latency,
    }
    if req.return_logprob:
        t = req.return_text_in_logprobs
        start = len(req.input_ids) - len(res.input_logprobs)
        meta["input_token_logprobs"] = _entries(
            list(zip(res.input_logprobs, req.input_ids[start:], strict=True)), t, decode)
        meta["output_token_logprobs"] = _entries(
            list(zip(res.output_logprobs, res.output_ids, strict=True)), t, decode)
        meta["output_token_logprobs_length"] = len(res.output_logprobs)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [None if row is None else _entries(row, t, decode) for row in res.input_top]
            meta["output_top_logprobs"] = [_entries(row, t, decode) for row in res.output_top]
    out: dict[str, Any] = {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}
    if return_prompt_token_ids:
        out["prompt_token_ids"] = req.input_ids
    return out
