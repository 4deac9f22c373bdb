"""Write a one-layer OCI image archive `FROM scratch` out of files on disk, with the standard library only.

hack/localnode.py uses it for the images a node needs that no registry can give here: the pause
image (containerd's sandbox_image), CoreDNS around its pinned binary, and the tests' probe image.
The archive is an OCI image layout in a tar (oci-layout, index.json, blobs/sha256/...), which
`ctr -n k8s.io image import` takes; the index names the image with `io.containerd.image.name`.
The layer is an uncompressed tar with fixed owners and times, so the same inputs give the same
digests (a re-import is a no-op for containerd).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True)
class ImageFile:
    """One file of the layer: its bytes come from `source` (a path) or `data`."""

    source: Path | None = None
    data: bytes | None = None
    mode: int = 0o755

    def content(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.source is not None, "an ImageFile needs a source or data"
        return Path(self.source).read_bytes()


def _layer(files: Mapping[str, ImageFile]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for name in sorted(files):
            parts = name.strip("/").split("/")
            for i in range(1, len(parts)):  # parent directories first, once each
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                    tar.addfile(info)
            body = files[name].content()
            info = tarfile.TarInfo("/".join(parts))
            info.size, info.mode, info.mtime = len(body), files[name].mode, 0
            tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def write_oci_archive(
    archive: Path,
    name: str,
    files: Mapping[str, ImageFile],
    entrypoint: Sequence[str],
    cmd: Sequence[str] = (),
    env: Sequence[str] = ("PATH=/",),
    user: str = "",
) -> str:
    """Write `archive` holding image `name` (e.g. "kora.local/pause:1"); return the manifest digest."""
    layer = _layer(files)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": list(entrypoint), "Cmd": list(cmd), "Env": list(env), "WorkingDir": "/", "User": user},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
        "history": [{"created_by": "hack/ociimage.py", "comment": "FROM scratch, one layer"}],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        layer_digest = _blob(tar, layer)
        config_digest = _blob(tar, config_bytes)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(config_bytes)},
            "layers": [{"mediaType": LAYER_TYPE, "digest": layer_digest, "size": len(layer)}],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        manifest_digest = _blob(tar, manifest_bytes)
        tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": MANIFEST_TYPE,
                    "digest": manifest_digest,
                    "size": len(manifest_bytes),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag},
                }
            ],
        }
        for fname, data in (
            ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
            ("index.json", json.dumps(index, sort_keys=True).encode()),
        ):
            info = tarfile.TarInfo(fname)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(archive)
    return manifest_digest
