"""kora's images, built from the repository's Dockerfile with buildah (hack/images.py, `make images`; issue 41 item 2):
the operator image runs `kora --help` as uid 65532 and carries no ML stack; the CPU trainer image runs the trainer's
entry point and `kora make-toy`, and holds exactly the pinned versions (constraints.txt) the tests run on; each is
written as an OCI archive a containerd node imports.

Slow: a cold build (debootstrap base, PyPI downloads, the torch layer) takes minutes; a warm one seconds. Skipped
without buildah/podman/debootstrap (`bash hack/install_tools.sh`) or root. Containers run with no network.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import images
import pins

# `full` for now: a cold build takes ~17 min and ~14 GB of disk on 2 cores, more than CI's 90 minutes can hold
# beside today's suite; it joins CI with the real-node e2e once the suite is cut (issue 41). `make images` and
# `make test-full` run it
pytestmark = [pytest.mark.slow, pytest.mark.full, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def built() -> Iterator[dict[str, dict]]:
    why = images.problem()
    if why:
        pytest.skip(f"cannot build images here: {why}")
    proc = subprocess.run([sys.executable, str(images.HERE / "images.py")], text=True, capture_output=True,
                          timeout=1700)
    assert proc.returncode == 0, f"hack/images.py failed:\n{proc.stderr[-6000:]}"
    manifest = json.loads((images.out_dir() / "images.json").read_text())
    for m in manifest:
        print(f"{m['image']}: {m['image_bytes'] / 2**20:.0f} MiB, archive {m['archive_bytes'] / 2**20:.0f} MiB")
    yield {m["target"]: m for m in manifest}
    images.release_cgroups()


def podman_run(image: str, *args: str, volume: Path | None = None, entrypoint: str | None = None) -> str:
    cmd = ["run", "--rm", "--network", "none"]
    if volume is not None:
        cmd += ["-v", f"{volume}:/out"]
    if entrypoint is not None:
        cmd += ["--entrypoint", entrypoint]
    proc = subprocess.run(images.podman_cmd(*cmd, image, *args), env=images.env(), text=True, capture_output=True,
                          timeout=600)
    assert proc.returncode == 0, f"podman run {image} {' '.join(args)}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_operator_image_runs_kora_as_65532_without_the_ml_stack(built):
    image = built["operator"]["image"]
    out = podman_run(image, "-c", "id -u; id -g; kora --help", entrypoint="sh")
    uid, gid, *help_text = out.splitlines()
    assert (uid, gid) == ("65532", "65532")
    assert "operator" in "\n".join(help_text) and "validate" in "\n".join(help_text)
    found = podman_run(image, "-c", "import importlib.util as u; print([m for m in ('torch', 'ray', 'transformers') "
                       "if u.find_spec(m)])", entrypoint="python")
    assert found.strip() == "[]", f"the operator image carries {found.strip()}"


def test_trainer_image_runs_the_trainer_and_makes_the_toy(built, tmp_path):
    image = built["trainer-cpu"]["image"]
    assert "--config" in podman_run(image, "python", "-m", "kora_trainer.train", "--help")
    tmp_path.chmod(0o777)
    info = json.loads(podman_run(image, "kora", "make-toy", "/out/toy", "--target", "0", volume=tmp_path)
                      .strip().splitlines()[-1])
    assert info["dir"] == "/out/toy"
    toy = tmp_path / "toy"
    assert (toy / "config.json").is_file() and (toy / "train.parquet").is_file(), sorted(p.name for p in toy.iterdir())


def test_trainer_image_holds_the_pinned_versions(built):
    image = built["trainer-cpu"]["image"]
    script = ("import json, sys, importlib.metadata as m; print(json.dumps({'python': '%d.%d' % sys.version_info[:2], "
              "'dists': {d.metadata['Name']: d.version for d in m.distributions()}}))")
    out = podman_run(image, "-c", script, entrypoint="python")
    seen = json.loads(out)
    assert seen["python"] == "3.11", "the CPU images run Debian bookworm's python3.11"
    have = {canonicalize_name(k): v for k, v in seen["dists"].items()}
    project = images.tomllib.loads((images.ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    needed = {canonicalize_name(Requirement(r).name)
              for r in project["dependencies"] + extras["trainer"] + extras["wandb"] + extras["diffusion"]}
    pinned = pins.for_python(seen["python"])
    drift = [f"{n}: {have.get(n, 'missing')} (pinned {v})" for n, v in pinned.items()
             if (n in needed or n in have) and have.get(n, "").split("+")[0] != v]
    assert not drift, f"the trainer image drifted from constraints.txt: {drift}"
    assert have.get("kora") == project["version"]


def test_each_image_is_an_oci_archive_naming_its_image(built):
    for m in built.values():
        with tarfile.open(m["archive"]) as tar:
            index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
            assert tar.getmember("oci-layout").isfile()
        names = [d.get("annotations", {}).get("org.opencontainers.image.ref.name") for d in index["manifests"]]
        assert any(n and m["image"].endswith(n) for n in names), (m["image"], names)
