"""`checkpoint.dtype`: the precision of a checkpoint's adapter file, with resume kept exact.

The adapter file (`adapter.safetensors`: what a user reads, copies or converts) is written in checkpoint.dtype.
Where that cast rounds a trained value (an fp32 adapter saved as bf16), the exact values of those tensors go into
the trainer state beside the optimizer's, as megatron keeps fp32 main parameters beside bf16 weights, and a resume
loads them: a resumed run goes on from the values the uninterrupted run held, not from their rounding. A cast that
rounds nothing (a bf16 adapter saved as bf16 or fp32) adds nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

EXACT = "exact_adapter"  # the key, in a checkpoint's trainer state, of the values its adapter file rounded

# checkpoint.dtype's values (config.sections.CheckpointDType): fp8 is E4M3, the format training and serving use
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[str(name)]
    except KeyError:
        raise ValueError(f"checkpoint.dtype {name!r}: one of {', '.join(DTYPES)}") from None


def split_for_file(adapter: Mapping[str, torch.Tensor], dtype: torch.dtype | None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the file's tensors, on the host in `dtype` (None: as they are), the exact values of the tensors that the
    cast rounds)."""
    written, exact = {}, {}
    for name, t in adapter.items():
        value = t.detach().contiguous().cpu()
        cast = value if dtype is None or value.dtype == dtype else value.to(dtype)
        written[name] = cast
        if cast is not value and not torch.equal(cast.to(value.dtype), value):
            exact[name] = value
    return written, exact


def as_trained(written: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor] | None
               ) -> dict[str, torch.Tensor]:
    """The adapter the run held when it saved: the file's tensors, the exact ones where the file rounded."""
    exact = exact or {}
    return {name: exact.get(name, t) for name, t in written.items()}
