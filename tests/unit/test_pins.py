"""The pinned versions (constraints.txt) are the one source of truth: pyproject, the Dockerfile, the GPU wheel script,
the megatron backend's recorded version and the tests' venv all agree with it (issue 41 item 2)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import pins

ROOT = Path(__file__).resolve().parents[2]
CPU_PYTHON = "3.11"  # this machine, CI and the CPU images (Debian bookworm's python3)
GPU_PYTHON = "3.12"  # the GPU machine and the SGLang-based GPU image
# a pinned version written out (name==1.2 or name>=1.2 also counts as naming one): only constraints.txt may
VERSION_LITERAL = re.compile(r"\b([A-Za-z][A-Za-z0-9_.-]*)(==|~=|>=)\s*\d")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def installed_requirements() -> list[Requirement]:
    """What the images and `make setup` install: the base dependencies and every extra."""
    project = pyproject()["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def group_requirements() -> list[Requirement]:
    return [Requirement(r) for group in pyproject()["dependency-groups"].values() for r in group if isinstance(r, str)]


def applies(req: Requirement, python: str) -> bool:
    return req.marker is None or req.marker.evaluate({"python_version": python, "python_full_version": python})


def test_every_line_is_an_exact_pin_and_one_per_python():
    assert pins.read(), "constraints.txt holds no pin"
    for python in (CPU_PYTHON, GPU_PYTHON):
        pins.for_python(python)  # raises on a name pinned twice for one Python


def test_a_line_that_is_not_an_exact_pin_is_refused(tmp_path):
    bad = tmp_path / "constraints.txt"
    bad.write_text("torch>=2.4\n")
    with pytest.raises(ValueError, match="not an exact pin"):
        pins.read(bad)


def test_every_dependency_kora_installs_is_pinned_and_pyproject_admits_the_pin():
    cpu = pins.for_python(CPU_PYTHON)
    for req in installed_requirements():
        name = canonicalize_name(req.name)
        assert name in cpu, f"pyproject needs {req} but constraints.txt pins no {name}"
        assert req.specifier.contains(cpu[name], prereleases=True), (
            f"pyproject's {req} excludes the pinned {name}=={cpu[name]}: move the range or the pin")


def test_pyprojects_own_exact_versions_are_the_pinned_ones():
    """The test group's megatron-core==0.16.1 (Python < 3.12) is constraints.txt's, for each Python it applies to."""
    for req in installed_requirements() + group_requirements():
        for spec in req.specifier:
            if spec.operator != "==":
                continue
            for python in (CPU_PYTHON, GPU_PYTHON):
                if applies(req, python):
                    pinned = pins.for_python(python).get(canonicalize_name(req.name))
                    assert pinned == spec.version, (
                        f"pyproject pins {req} but constraints.txt says {req.name}=={pinned} on Python {python}")


def test_megatron_backend_records_the_gpu_pin():
    tree = ast.parse((ROOT / "trainer/kora_trainer/backends/megatron/__init__.py").read_text())
    recorded = next(node.value.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", "") == "MEGATRON_CORE_VERSION" for t in node.targets)
                    and isinstance(node.value, ast.Constant))
    assert recorded == pins.for_python(GPU_PYTHON)["megatron-core"]


def _instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in dockerfile.splitlines():
        if not current and line.lstrip().startswith("#"):
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if current.strip():
                out.append(current.strip())
            current = ""
    return out


def test_the_dockerfile_takes_every_version_from_constraints():
    dockerfile = (ROOT / "Dockerfile").read_text()
    instructions = _instructions(dockerfile)
    named = [(m.group(0), i) for i in instructions if i.split()[0] in ("RUN", "ARG", "ENV")
             for m in VERSION_LITERAL.finditer(i)]
    assert not named, f"the Dockerfile names versions of its own (constraints.txt is the one place): {named}"
    assert not [i for i in instructions if re.match(r"ARG \w*_VERSION=", i)], "a version ARG in the Dockerfile"
    assert any(i.startswith("COPY constraints.txt") for i in instructions)
    assert "PIP_CONSTRAINT=/opt/kora/constraints.txt" in dockerfile
    assert "!constraints.txt" in (ROOT / ".dockerignore").read_text().split()
    # each stage that pip-installs reads the pins: the CPU stages through the python stage's PIP_CONSTRAINT, the GPU
    # stage through its own copy
    gpu = dockerfile[dockerfile.index("AS trainer\n"):]
    assert "PIP_CONSTRAINT=/tmp/kora-constraints.txt pip install" in gpu


def test_the_gpu_wheel_script_takes_its_versions_from_constraints():
    script = (ROOT / "hack/gpu_wheels.sh").read_text()
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert not VERSION_LITERAL.findall(code), "hack/gpu_wheels.sh names versions of its own"
    assert "hack/pins.py --python 3.12" in code
    assert pins.main(["--python", GPU_PYTHON, "megatron-core", "ray", "pydantic", "pydantic-settings",
                      "cuda-bindings"]) == 0


def test_the_venv_holds_the_pinned_versions():
    """The tests ran on the pinned versions: `make setup` installs constraints.txt into .venv."""
    venv = ROOT / ".venv"
    if not venv.exists() or Path(sys.prefix).resolve() != venv.resolve():
        pytest.skip(f"not running in the repository's venv ({sys.prefix}): another machine's own versions")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    wanted = {canonicalize_name(r.name) for r in installed_requirements() + group_requirements() if applies(r, python)}
    drift = []
    for name, version in pins.for_python(python).items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name in wanted:
                drift.append(f"{name} not installed (pinned {version})")
            continue
        if have.split("+")[0] != version:
            drift.append(f"{name} {have} (pinned {version})")
    assert not drift, f"the venv drifted from constraints.txt (make setup reinstalls it): {drift}"
