"""hack/ociimage.py: the OCI archives the real node imports (pause, CoreDNS, the probe) are well formed."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

from ociimage import ImageFile, write_oci_archive


def _blob(tar: tarfile.TarFile, digest: str) -> bytes:
    f = tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
    assert f is not None
    data = f.read()
    assert hashlib.sha256(data).hexdigest() == digest.removeprefix("sha256:")
    return data


def test_archive_is_an_oci_layout_naming_the_image(tmp_path: Path) -> None:
    (tmp_path / "bin").write_bytes(b"\x7fELF fake")
    archive = tmp_path / "img.tar"
    digest = write_oci_archive(
        archive, "kora.local/x:2", {"usr/bin/x": ImageFile(tmp_path / "bin"), "etc/conf": ImageFile(data=b"a=1")},
        ["/usr/bin/x"], cmd=["serve"],
    )  # fmt: skip
    with tarfile.open(archive) as tar:
        assert json.loads(tar.extractfile("oci-layout").read()) == {"imageLayoutVersion": "1.0.0"}  # type: ignore[union-attr]
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
        (entry,) = index["manifests"]
        assert entry["digest"] == digest
        assert entry["annotations"]["io.containerd.image.name"] == "kora.local/x:2"
        assert entry["annotations"]["org.opencontainers.image.ref.name"] == "2"
        manifest = json.loads(_blob(tar, digest))
        config = json.loads(_blob(tar, manifest["config"]["digest"]))
        layer = _blob(tar, manifest["layers"][0]["digest"])
    assert config["config"]["Entrypoint"] == ["/usr/bin/x"] and config["config"]["Cmd"] == ["serve"]
    assert config["rootfs"]["diff_ids"] == [manifest["layers"][0]["digest"]]  # uncompressed: diff id = digest
    (tmp_path / "layer.tar").write_bytes(layer)
    with tarfile.open(tmp_path / "layer.tar") as lt:
        names = lt.getnames()
        assert lt.extractfile("usr/bin/x").read() == b"\x7fELF fake"  # type: ignore[union-attr]
        assert lt.getmember("usr/bin/x").mode == 0o755 and lt.getmember("usr/bin/x").mtime == 0
    assert names.index("usr") < names.index("usr/bin") < names.index("usr/bin/x")


def test_same_inputs_same_digest(tmp_path: Path) -> None:
    files = {"pause": ImageFile(data=b"binary")}
    a = write_oci_archive(tmp_path / "a.tar", "kora.local/pause:1", files, ["/pause"])
    b = write_oci_archive(tmp_path / "b.tar", "kora.local/pause:1", files, ["/pause"])
    assert a == b
