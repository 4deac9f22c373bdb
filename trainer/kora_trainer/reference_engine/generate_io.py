"""`/generate` bodies in and out, in SGLang's shapes (sglang 0.5.23 `GenerateReqInput`, IO:176, and
the response built in `TokenizerManager._handle_batch_output`, TM:2480).

In: `text` or `input_ids` (one prompt, or a list = a batch), `sampling_params` (one dict for all,
or one per prompt), `n` samples per prompt (the n samples of prompt i are adjacent in the
response), per-prompt or shared `return_logprob` / `logprob_start_len` / `top_logprobs_num`,
`lora_path` (an adapter *name*; a list gives one per prompt, null = base model), `rid`.

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

from kora_trainer.reference_engine.lora_adapters import LoRAAdapter
from kora_trainer.reference_engine.model import GenRequest, GenResult
from kora_trainer.reference_engine.request_bodies import GenerateReqInput, parse
from kora_trainer.reference_engine.sampling import SamplingParams


@dataclass
class ParsedGenerate:
    requests: list[GenRequest]
    single: bool  # answer with one object instead of a list
    return_prompt_token_ids: bool
    stream: bool


def _per_item(value: Any, i: int, default: Any) -> Any:
    if isinstance(value, list):
        return value[i] if i < len(value) and value[i] is not None else default
    return default if value is None else value


def parse_generate(body: dict[str, Any], tokenize: Callable[[str], list[int]],
                   resolve_adapter: Callable[[str | None], LoRAAdapter | None]) -> ParsedGenerate:
    """Raises ValueError with SGLang's messages; the contract gate has already checked JSON types."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise ValueError("input_embeds is not supported by kora's hf engine")
    if text is None and input_ids is None:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:  # text wins when both are sent
        batched = isinstance(text, list)
        prompts = [tokenize(t) for t in (text if batched else [text])]
    else:
        assert input_ids is not None
        if input_ids == []:
            raise ValueError("input_ids cannot be empty.")
        batched = isinstance(input_ids[0], list)
        prompts = [list(p) for p in (input_ids if batched else [input_ids])]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("input_ids cannot be empty.")

    raw_sp = body.get("sampling_params")
    if isinstance(raw_sp, list):
        if len(raw_sp) != len(prompts):
            raise ValueError(f"sampling_params has {len(raw_sp)} entries for a batch of {len(prompts)} prompts.")
        params = [SamplingParams.from_json(sp) for sp in raw_sp]
        if len({p.n for p in params}) > 1:
            raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
    else:
        params = [SamplingParams.from_json(raw_sp)] * len(prompts)
    n = params[0].n if params else 1

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
                input_ids=prompt, params=params[i], adapter=adapter,
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
