"""The pinned Python versions (constraints.txt at the repository root): read them, for one Python version.

    python hack/pins.py --python 3.12 megatron-core ray      # megatron-core==0.19.2 ray==2.60.0, one a line

constraints.txt is the one source of truth: `make setup` and the Dockerfile hand it to pip as it is; hack/gpu_wheels.sh
asks this script for the GPU machine's (Python 3.12) pins; tests/unit/test_pins.py holds pyproject, the Dockerfile,
gpu_wheels.sh and the venv to it. Standard library + `packaging` (or pip's vendored copy), so any python3 runs it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare python3 (the GPU wheel script's): pip ships the same library
    from pip._vendor.packaging.markers import Marker  # type: ignore[assignment]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[assignment]

CONSTRAINTS = Path(__file__).resolve().parent.parent / "constraints.txt"
SGLANG_IMAGE_TAG = "# sglang-image"


@dataclass(frozen=True)
class Pin:
    name: str  # canonical (PEP 503) name
    version: str
    marker: Marker | None
    sglang_image: bool  # the SGLang base image brings its own (the GPU `trainer` target keeps the base's)
    line: str

    def applies(self, python: str) -> bool:
        return self.marker is None or self.marker.evaluate({"python_version": python, "python_full_version": python})


def read(path: Path = CONSTRAINTS) -> list[Pin]:
    """Every pin in the file; a line that is not `name==version[; marker]` is an error, not skipped."""
    pins = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        text, _, comment = raw.partition("#")
        text = text.strip()
        if not text:
            continue
        req = Requirement(text)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version or req.extras:
            raise ValueError(f"{path.name}:{n}: {raw!r} is not an exact pin `name==version`")
        pins.append(Pin(canonicalize_name(req.name), specs[0].version, req.marker,
                        SGLANG_IMAGE_TAG in "#" + comment, raw.strip()))
    return pins


def for_python(python: str, path: Path = CONSTRAINTS) -> dict[str, str]:
    """name -> version of the pins that apply on this Python version (one each: two that apply is an error)."""
    out: dict[str, str] = {}
    for pin in read(path):
        if pin.applies(python):
            if pin.name in out:
                raise ValueError(f"{pin.name} is pinned twice for Python {python}")
            out[pin.name] = pin.version
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    ap.add_argument("names", nargs="*", help="print only these (default: every pin that applies)")
    args = ap.parse_args(argv)
    pins = for_python(args.python)
    names: list[str] = [canonicalize_name(n) for n in args.names] or sorted(pins)
    missing = [n for n in names if n not in pins]
    if missing:
        print(f"pins.py: no pin for {', '.join(missing)} on Python {args.python} in {CONSTRAINTS}", file=sys.stderr)
        return 1
    for name in names:
        print(f"{name}=={pins[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
