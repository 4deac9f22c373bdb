"""Shared test setup: make hack/ importable (hack/localcluster.py, a stdlib-only module) and
tests/ itself (shared helpers such as tests/specs.py), whatever pytest's import mode; and the fixtures
several test directories use."""

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
for _path in (TESTS_DIR.parent / "hack", TESTS_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory):
    """The toy model, tokenizer and dataset (kora make-toy), untrained: the pipeline is under test, not
    the skill. Made once per session; tests only read it."""
    from kora_trainer.toys.lm import make_toy

    out = tmp_path_factory.mktemp("toy") / "toy"
    make_toy(out, target=0.0)
    return out


@pytest.fixture(scope="session")
def diffusion_toy_dir(tmp_path_factory):
    """The diffusion toy (kora make-toy --diffusion), made once per session; tests only read it."""
    from kora_trainer.toys.diffusion import make_diffusion_toy

    out = tmp_path_factory.mktemp("diffusion-toy") / "toy"
    make_diffusion_toy(out)
    return out


@pytest.fixture(scope="session")
def vl_toy_dir(tmp_path_factory):
    """The vision-language toy (kora make-toy --vl), briefly pretrained as the command makes it (~10 s); tests only
    read it."""
    from kora_trainer.toys.vl import make_vl_toy

    out = tmp_path_factory.mktemp("vl_toy") / "vl_toy"
    make_vl_toy(out)
    return out
