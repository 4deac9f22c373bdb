"""Image prompts as the trainer and the engines both handle them (vision-language models: docs/vl.md).

What goes over the wire is SGLang's: `/generate` takes `image_data` beside `input_ids` (sglang 0.5.23 io_struct.py
`GenerateReqInput.image_data: Optional[MultimodalDataInputFormat]`; an item is "an image instance, file name, URL, or
base64 encoded string", one per request of a batch or a list per request). kora sends each image as base64 of the
file's own bytes (`image_item`): no file name or URL, so the engine needs no access to the trainer's volume.

The prompt ids carry the image placeholder already expanded (`<|vision_start|>` + one `<|image_pad|>` per merged
patch + `<|vision_end|>`), which is what the trainer scores; SGLang's Qwen-VL processors match that expanded form as
well as the single placeholder (`image_token_regex` "<|vision_start|>(?:<|image_pad|>)+<|vision_end|>",
multimodal/processors/qwen_vl.py), and the reference engine checks the count against its own image processor.

Positions: Qwen-VL models use multimodal RoPE (3 position rows; text tokens after an image advance by the image's
grid, not its token count). `mrope_positions` builds them from the model's own `get_rope_index` for a whole
left- or right-padded batch, so the engine's prefill and decode and the trainer's forward give every token the
same position: the row-0 text positions (transformers 5's 4-row form) plus the 3 mrope rows.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

DATA_URL_PREFIX = "data:image/"


def is_vision_language(hf_config: Any) -> bool:
    """A config (PretrainedConfig or config.json dict) that declares a vision tower."""
    if isinstance(hf_config, Mapping):
        return bool(hf_config.get("vision_config"))
    return getattr(hf_config, "vision_config", None) is not None


def load_policy_model(path: str, dtype: Any = "auto") -> nn.Module:
    """The model class both sides load: a VL checkpoint with its vision tower (AutoModelForImageTextToText:
    AutoModelForCausalLM would build the text-only class and drop the tower), else the causal LM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: PLC0415 - transformers is heavy: loaded on use

    cls = AutoModelForImageTextToText if is_vision_language(AutoConfig.from_pretrained(path)) else AutoModelForCausalLM
    return cast(nn.Module, cls.from_pretrained(path, dtype=dtype))


def image_item(data: bytes) -> str:
    """One `image_data` item: the image file's bytes, base64."""
    return base64.b64encode(data).decode("ascii")


def decode_image_item(item: Any, field: str = "image_data") -> Any:
    """An `image_data` item (base64, or a `data:image/...;base64,` URL) -> a PIL RGB image; ValueError naming the
    field otherwise (a file name or URL is refused: the engine reads nothing but the request)."""
    from PIL import Image  # noqa: PLC0415 - Pillow only for image prompts

    if not isinstance(item, str):
        raise ValueError(f"{field}: an image must be a base64 string (or a data:image/...;base64 URL), "
                         f"not {type(item).__name__}")
    text = item.split(",", 1)[1] if item.startswith(DATA_URL_PREFIX) else item
    try:
        raw = base64.b64decode(text, validate=True)
        return Image.open(io.BytesIO(raw)).convert("RGB")
    except Exception as e:  # binascii.Error, PIL.UnidentifiedImageError, ...
        raise ValueError(f"{field}: not a base64-encoded image ({type(e).__name__}): send the image file's bytes "
                         "base64-encoded (file names and URLs are not read by this engine)") from None


@dataclass
class ImageInputs:
    """One prompt's images as the vision tower takes them: pixel_values [P, C*T*ps*ps] (P patches of all its
    images), image_grid_thw [n_images, 3]."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    def tokens(self, merge: int) -> list[int]:
        """Placeholder tokens per image (a merge x merge block of patches is one token)."""
        return [int(g.prod()) // (merge * merge) for g in self.image_grid_thw]


def load_image_processor(path: str) -> Any:
    from transformers import AutoImageProcessor  # noqa: PLC0415 - transformers is heavy: loaded on use

    return AutoImageProcessor.from_pretrained(path)


def process_images(image_processor: Any, images: Sequence[Any]) -> ImageInputs:
    out = image_processor(images=list(images), return_tensors="pt")
    return ImageInputs(out["pixel_values"], out["image_grid_thw"])


def images_from_bytes(image_processor: Any, files: Sequence[bytes]) -> ImageInputs:
    from PIL import Image  # noqa: PLC0415 - Pillow only for image prompts

    return process_images(image_processor, [Image.open(io.BytesIO(f)).convert("RGB") for f in files])


def read_image_file(path: str | Path) -> bytes:
    return Path(path).read_bytes()


@dataclass(frozen=True)
class VisionTokens:
    """The special tokens of a VL config (Qwen-VL names)."""

    image: int
    start: int
    end: int
    merge: int

    @classmethod
    def of(cls, hf_config: Any) -> VisionTokens:
        return cls(int(hf_config.image_token_id), int(hf_config.vision_start_token_id),
                   int(hf_config.vision_end_token_id), int(hf_config.vision_config.spatial_merge_size))


def expand_placeholders(ids: Sequence[int], tokens: VisionTokens, counts: Sequence[int]) -> list[int]:
    """Prompt ids with each image's `<|image_pad|>` run made `counts[i]` long. A run already of that length is
    kept (an expanded prompt); any other run length, or a run count that differs from the images, is a
    ValueError naming input_ids and image_data."""
    out: list[int] = []
    runs = 0
    i = 0
    while i < len(ids):
        if ids[i] != tokens.image:
            out.append(int(ids[i]))
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == tokens.image:
            j += 1
        if runs >= len(counts):
            raise ValueError(f"input_ids hold more image placeholders than image_data has images ({len(counts)})")
        if j - i not in (1, counts[runs]):
            raise ValueError(f"input_ids: image {runs} has {j - i} placeholder tokens; its image makes {counts[runs]} "
                             "(send one placeholder per image, or the expanded run)")
        out.extend([tokens.image] * counts[runs])
        runs += 1
        i = j
    if runs != len(counts):
        raise ValueError(f"input_ids hold {runs} image placeholders for {len(counts)} images in image_data: "
                         "one <|vision_start|><|image_pad|><|vision_end|> per image")
    return out


def stack_images(rows: Sequence[ImageInputs | None]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A batch's images in row order, as one forward takes them: (pixel_values, image_grid_thw), or Nones."""
    have = [r for r in rows if r is not None]
    if not have:
        return None, None
    return torch.cat([r.pixel_values for r in have]), torch.cat([r.image_grid_thw for r in have])


def image_token_mask(ids: torch.Tensor, image_token: int, prompt_end: Sequence[int]) -> torch.Tensor:
    """[B, T] True on the prompt's image placeholders: an `<|image_pad|>` the policy generated (columns at or past
    prompt_end[b]) is a text token, as SGLang treats it (its image offsets come from the prompt alone)."""
    cols = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # [1, T]
    ends = torch.tensor(list(prompt_end), device=ids.device).unsqueeze(1)  # [B, 1]
    return (ids == image_token) & (cols < ends)


def mrope_positions(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, grid: torch.Tensor | None,
                    images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [4, B, T]: text positions then the 3 mrope rows, rope deltas [B, 1]) for ids [B, T] with
    attention mask [B, T] (padding anywhere) and image-token mask `images` [B, T]: a decode step at text position p
    of row b takes p + delta[b]."""
    text = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
    if grid is None:
        return text.unsqueeze(0).expand(4, -1, -1), torch.zeros((ids.shape[0], 1), dtype=torch.long,
                                                                 device=ids.device)
    inner = cast(Any, model.get_submodule("model"))  # the HF VL model's inner model (typed as a plain Module)
    mm_type = images.long() * mask.long()  # [B, T]: 1 on image tokens
    rope, deltas = inner.get_rope_index(ids, image_grid_thw=grid, attention_mask=mask, mm_token_type_ids=mm_type)
    return torch.cat([text.unsqueeze(0), rope.to(text.dtype)], dim=0), deltas.to(text.device)


def decode_positions(text_pos: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """[B, 1] text positions of a decode step -> [4, B, 1] (the mrope rows shifted by each row's delta)."""
    rope = (text_pos + deltas).unsqueeze(0).expand(3, -1, -1)
    return torch.cat([text_pos.unsqueeze(0), rope], dim=0)


def chat_prompt(tokenizer: Any, text: str, n_images: int) -> str:
    """The chat template's prompt for one user turn: its images first, then the text (the HF processor's
    message layout), with the generation prompt."""
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return str(tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True))


def prompt_ids(tokenizer: Any, tokens: VisionTokens, text: str, images: ImageInputs) -> list[int]:
    """A VL prompt's token ids: the chat template's text, each image's placeholder expanded to its token count
    (what the HF processor does), tokenized without adding special tokens again (the template holds them)."""
    ids = tokenizer(chat_prompt(tokenizer, text, len(images.image_grid_thw)), add_special_tokens=False)["input_ids"]
    return expand_placeholders(ids, tokens, images.tokens(tokens.merge))


def forward_inputs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, rows: Sequence[ImageInputs | None],
                   image_token: int, prompt_end: Sequence[int]) -> tuple[dict[str, Any], torch.Tensor]:
    """(the keyword arguments of a VL forward over ids [B, T] / mask [B, T] whose row b holds rows[b]'s images in
    its prompt, columns < prompt_end[b]; the rope deltas [B, 1] its decode steps continue from).

    The image features go in as `inputs_embeds`, scattered onto the prompt's placeholders only: given input_ids and
    pixel_values, transformers would scatter onto every `<|image_pad|>` id, a sampled one included, and refuse the
    count."""
    pixels, grid = stack_images(rows)
    where = image_token_mask(ids, image_token, prompt_end)  # [B, T]
    pos, deltas = mrope_positions(model, ids, mask, grid, where)
    kwargs: dict[str, Any] = {"position_ids": pos.to(ids.device)}
    if pixels is None or grid is None:
        kwargs["input_ids"] = ids
        return kwargs, deltas
    inner = cast(Any, model.get_submodule("model"))
    embeds = cast(Any, model).get_input_embeddings()(ids)  # [B, T, H]
    dtype = embeds.dtype
    feats = torch.cat(list(inner.get_image_features(pixels.to(ids.device, dtype), grid.to(ids.device),
                                                    return_dict=True).pooler_output), dim=0)  # [n_tokens, H]
    if feats.shape[0] != int(where.sum()):
        raise ValueError(f"image_data: the images make {feats.shape[0]} tokens, the prompts hold "
                         f"{int(where.sum())} image placeholders")
    kwargs["inputs_embeds"] = embeds.masked_scatter(where.unsqueeze(-1), feats.to(dtype))
    return kwargs, deltas

