"""IPython.display's two names SGLang imports; calling them means a notebook, which the device never is."""

from typing import Any


def HTML(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("IPython is not carried to the GPU device (hack/sglang_carry.sh)")


def display(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("IPython is not carried to the GPU device (hack/sglang_carry.sh)")
