#!/usr/bin/env python3
"""`make images`: kora's operator and CPU trainer images, built from the repository's Dockerfile with buildah.

No Docker engine and no container registry are needed (issue 41 item 2): the base image is a Debian bookworm made here
by `debootstrap --variant=minbase` (what debian:bookworm-slim is made from) and `podman import`ed once; `buildah bud`
builds the Dockerfile's targets FROM it (build arg BASE_IMAGE); `podman save --format oci-archive` writes each image to
.kora/images/<name>.tar, which `ctr -n k8s.io image import` (a containerd node) or `podman load` take.

    python hack/images.py [build] [--target operator --target trainer-cpu] [--base IMAGE] [--no-save] [--compress]
    python hack/images.py podman ARGS...     podman on our storage and settings (`... podman images`, `... podman run`)
    python hack/images.py clean              remove the image store (every cached layer and the base)

Needs root, and buildah, podman and debootstrap (`bash hack/install_tools.sh` installs those that are missing).

Where things live: the image store, pip's download cache (buildah's cache mount) and the build temp files in
$KORA_IMAGES_STORE (default ~/.cache/kora-images, kept across `make clean`); the archives in .kora/images/ (git-ignored)
with images.json describing them. Our settings (hack/images/containers.conf, a storage.conf written into the store)
reach podman and buildah through CONTAINERS_CONF / CONTAINERS_STORAGE_CONF: the machine's /etc/containers is not
changed. Build steps use the host's network namespace (`--network host`), so no bridge or iptables rule is made; pip
reaches PyPI with the machine's CA bundle, handed to the build as the secret `ca` (never in a layer).

Caching: buildah keeps every step's layer (--layers) and the Dockerfile installs the dependencies before it copies
kora's code, so a rebuild with nothing changed takes seconds, and one after a code change rebuilds only the wheel and
the layer that installs it. The archive is rewritten only when the image changed. Layers that no image of the last
build uses (a superseded dependency layer, say) are removed after each build, so the store does not grow without end.

Environment: KORA_BASE_IMAGE (build FROM this instead of the debootstrap base, e.g. debian:bookworm-slim where a
registry is reachable), KORA_DEBIAN_MIRROR (default http://deb.debian.org/debian), KORA_CA_BUNDLE (default: PIP_CERT,
SSL_CERT_FILE, or /etc/ssl/certs/ca-certificates.crt), KORA_IMAGES_STORE, KORA_IMAGES_OUT (default .kora/images).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONTAINERS_CONF = HERE / "images" / "containers.conf"
SUITE = "bookworm"
TOOLS = ("buildah", "podman", "debootstrap")
# debian:bookworm-slim's trims, so the debootstrap base matches it: no docs, man pages or translations installed
DPKG_SLIM = """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
"""
# and its apt settings (debuerreotype's "docker-*" files): no .deb or package cache left in a layer, no translations
_APT_CLEAN = "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"
APT_SLIM = f"""\
DPkg::Post-Invoke {{ "{_APT_CLEAN}"; }};
APT::Update::Post-Invoke {{ "{_APT_CLEAN}"; }};
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
Acquire::GzipIndexes "true";
Acquire::CompressionTypes::Order:: "gz";
APT::AutoRemove::SuggestsImportant "false";
"""
DEBIAN_SOURCES = """\
Types: deb
URIs: {mirror}
Suites: {suite} {suite}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: {security}
Suites: {suite}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
# what `podman import` gives the base image's config (a root filesystem tarball carries none)
BASE_CHANGES = ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", 'CMD ["bash"]')


def version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


@dataclass(frozen=True)
class Target:
    target: str  # the Dockerfile stage
    name: str  # the image's name (the chart's image.repository for the operator)
    archive: str  # file name under the output directory


def targets() -> dict[str, Target]:
    v = version()
    return {
        "operator": Target("operator", f"ghcr.io/kora-dev/kora-operator:{v}", "kora-operator.tar"),
        "trainer-cpu": Target("trainer-cpu", f"ghcr.io/kora-dev/kora-trainer:{v}-cpu", "kora-trainer-cpu.tar"),
    }


def log(msg: str) -> None:
    print(f"[images {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def store() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kora-images"
    return Path(os.environ.get("KORA_IMAGES_STORE") or default).resolve()


def out_dir() -> Path:
    return Path(os.environ.get("KORA_IMAGES_OUT") or ROOT / ".kora" / "images").resolve()


def problem() -> str:
    """Why images cannot be built here ('' when they can): the image test's skip reason too."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not on PATH (bash hack/install_tools.sh installs them)"
    if os.geteuid() != 0:
        return "needs root: buildah and podman run rootful here (rootless needs subuid/subgid ranges for the user)"
    return ""


def env() -> dict[str, str]:
    """The environment podman and buildah run in: our settings and storage, never the machine's /etc."""
    s = store()
    for sub in ("storage", "run", "tmp"):
        (s / sub).mkdir(parents=True, exist_ok=True)
    conf = s / "storage.conf"
    text = f'[storage]\ndriver = "overlay"\ngraphroot = "{s / "storage"}"\nrunroot = "{s / "run"}"\n'
    if not conf.exists() or conf.read_text() != text:
        conf.write_text(text)
    # TMPDIR: buildah's build files and its cache mounts (pip's downloads: <TMPDIR>/buildah-cache-0) stay in the store
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF), "CONTAINERS_STORAGE_CONF": str(conf),
            "TMPDIR": str(s / "tmp")}


def podman_cmd(*args: str) -> list[str]:
    """podman on our store; its own state (libpod's tmp dir, events log) under the store's run/ too."""
    return ["podman", "--tmpdir", str(store() / "run" / "libpod"), *args]


def release_cgroups(wait: float = 5.0) -> None:
    """podman (cgroupfs) makes libpod_parent/ (and conmon/ in it) in every cgroup v1 controller and leaves them when
    its containers are gone: remove them once empty (rmdir fails on a cgroup still holding a process or a child, so a
    running container's are kept). runc removes each container's own cgroup itself; conmon outlives `podman run` by a
    moment, so wait up to `wait` seconds for its cgroup to empty."""
    deadline = time.monotonic() + wait
    while True:
        for parent in Path("/sys/fs/cgroup").glob("*/libpod_parent"):
            for path in (parent / "conmon", parent):
                with contextlib.suppress(OSError):
                    path.rmdir()
        if not any(Path("/sys/fs/cgroup").glob("*/libpod_parent")) or time.monotonic() > deadline:
            return
        time.sleep(0.2)


def run(cmd: Sequence[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), env=env(), text=True, check=True, **kw)  # type: ignore[call-overload,no-any-return]


def exists(image: str) -> bool:
    return subprocess.run(podman_cmd("image", "exists", image), env=env()).returncode == 0


def image_id(image: str) -> str:
    return run(podman_cmd("image", "inspect", "--format", "{{.Id}}", image), capture_output=True).stdout.strip()


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """One build at a time per store (two builds would both debootstrap, and race on the archives)."""
    path = store() / "lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    found = []
    for line in Path("/proc/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)  # deepest first


def remove_tree(path: Path) -> None:
    """rm -rf, after unmounting whatever a failed debootstrap left mounted inside (proc, sys)."""
    for point in mounts_under(path):
        subprocess.run(["umount", "-l", point], check=False)
    shutil.rmtree(path, ignore_errors=True)


def base_image() -> str:
    """The debootstrap base, made once per recipe (its name carries the recipe's hash)."""
    mirror = os.environ.get("KORA_DEBIAN_MIRROR", "http://deb.debian.org/debian").rstrip("/")
    security = mirror.rsplit("/", 1)[0] + "/debian-security" if mirror.endswith("/debian") else mirror + "-security"
    recipe = "\n".join([SUITE, "minbase", mirror, security, DPKG_SLIM, APT_SLIM, DEBIAN_SOURCES, *BASE_CHANGES])
    name = f"localhost/kora-base:{SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if exists(name):
        return name
    rootfs = store() / "tmp" / f"rootfs-{os.getpid()}"
    remove_tree(rootfs)
    t0 = time.monotonic()
    log(f"debootstrap --variant=minbase {SUITE} (about a minute) -> {name}")
    try:
        subprocess.run(["debootstrap", "--variant=minbase", SUITE, str(rootfs), mirror], check=True,
                       stdout=subprocess.DEVNULL)
        slim(rootfs, mirror, security)
        tar = subprocess.Popen(["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-c", "."],
                               stdout=subprocess.PIPE)
        changes = [a for c in BASE_CHANGES for a in ("--change", c)]
        run(podman_cmd("import", *changes, "-", name), stdin=tar.stdout, stdout=subprocess.DEVNULL)
        if tar.wait() != 0:
            raise subprocess.CalledProcessError(tar.returncode, "tar")
    finally:
        remove_tree(rootfs)
    log(f"base {name} in {time.monotonic() - t0:.0f} s")
    return name


def slim(rootfs: Path, mirror: str, security: str) -> None:
    """What debian:bookworm-slim differs in from a fresh minbase: apt sources with updates and security, dpkg's
    path excludes and apt's cache cleaning, and nothing of the machine that made it (hostname, resolv.conf, device
    nodes, apt's caches)."""
    (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
    (rootfs / "etc/apt/sources.list.d/debian.sources").write_text(
        DEBIAN_SOURCES.format(mirror=mirror, security=security, suite=SUITE))
    (rootfs / "etc/dpkg/dpkg.cfg.d/kora-slim").write_text(DPKG_SLIM)
    (rootfs / "etc/apt/apt.conf.d/kora-slim").write_text(APT_SLIM)
    for rel in ("etc/hostname", "etc/resolv.conf"):
        (rootfs / rel).unlink(missing_ok=True)
    globs = ("dev/*", "tmp/*", "var/tmp/*", "var/log/*.log", "var/lib/apt/lists/*", "var/cache/apt/*.bin",
             "var/cache/apt/archives/*.deb", "var/cache/debconf/*-old", "usr/share/doc/*", "usr/share/man/*",
             "usr/share/info/*", "usr/share/locale/*")
    for pattern in globs:
        for path in rootfs.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif not (pattern == "usr/share/doc/*" and path.name == "copyright"):
                path.unlink()


def ca_bundle() -> str | None:
    for candidate in (os.environ.get("KORA_CA_BUNDLE"), os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


LAYER_LINE = re.compile(r"^--> (?:Using cache )?([0-9a-f]{10,64})\s*$")


def build(t: Target, base: str) -> set[str]:
    """buildah bud one target; returns the ids of every layer the build used or made (kept by the prune)."""
    cmd = ["buildah", "bud", "--layers", "--network", "host", "--target", t.target, "-t", t.name,
           "--build-arg", f"BASE_IMAGE={base}", "-f", str(ROOT / "Dockerfile")]
    ca = ca_bundle()
    if ca:
        cmd += ["--secret", f"id=ca,src={ca}"]
    t0 = time.monotonic()
    log(f"buildah bud --target {t.target} -t {t.name}")
    proc = subprocess.Popen([*cmd, str(ROOT)], env=env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    used = set()
    for line in proc.stdout:
        sys.stderr.write(line)
        m = LAYER_LINE.match(line.strip())
        if m:
            used.add(m.group(1))
    if proc.wait() != 0:
        raise SystemExit(f"buildah bud --target {t.target} failed (exit {proc.returncode})")
    log(f"{t.name} built in {time.monotonic() - t0:.1f} s")
    return used


def prune(keep: set[str]) -> None:
    """Remove untagged images (build layers) that no image of this build used: a superseded dependency layer is
    gigabytes. Removing a leaf can orphan its parent, so repeat until nothing more goes."""
    for _ in range(50):
        out = run(podman_cmd("images", "--all", "--filter", "dangling=true", "--format", "{{.ID}}"),
                  capture_output=True).stdout.split()
        stale = [i for i in out if not any(k.startswith(i) or i.startswith(k) for k in keep)]
        if not stale:
            return
        gone = subprocess.run(podman_cmd("rmi", *stale), env=env(), text=True, capture_output=True)
        if gone.returncode != 0 and "image used by" not in gone.stderr and "in use" not in gone.stderr:
            log(f"prune: {gone.stderr.strip()[:300]}")
            return


def save(t: Target, compress: bool = False) -> dict[str, object]:
    """The image as an OCI archive, rewritten only when the image changed (its id beside it in <archive>.id).
    Layers uncompressed unless asked: gzip on one core took 407 s for the trainer's 6.6 GiB (uncompressed: a disk
    write), and a node importing from the same disk gains nothing from it."""
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    archive, stamp = out / t.archive, out / (t.archive + ".id")
    iid = image_id(t.name)
    want = f"{iid} {'gzip' if compress else 'uncompressed'}"
    if not (archive.exists() and stamp.exists() and stamp.read_text().strip() == want):
        t0 = time.monotonic()
        tmp = archive.with_suffix(".tar.tmp")
        tmp.unlink(missing_ok=True)
        run(podman_cmd("save", "--format", "oci-archive", *([] if compress else ["--uncompressed"]), "-o", str(tmp),
                       t.name), stdout=subprocess.DEVNULL)
        tmp.replace(archive)
        stamp.write_text(want + "\n")
        log(f"{archive} written in {time.monotonic() - t0:.1f} s")
    size = int(run(podman_cmd("image", "inspect", "--format", "{{.Size}}", t.name), capture_output=True).stdout)
    return {"target": t.target, "image": t.name, "id": iid, "archive": str(archive),
            "archive_bytes": archive.stat().st_size, "image_bytes": size}


def cmd_build(args: argparse.Namespace) -> int:
    why = problem()
    if why:
        print(f"images: {why}", file=sys.stderr)
        return 2
    chosen = [targets()[n] for n in args.target or targets()]
    t0 = time.monotonic()
    with locked():
        base = os.environ.get("KORA_BASE_IMAGE") or args.base or base_image()
        keep: set[str] = set()
        for t in chosen:
            keep |= build(t, base)
        prune(keep)
        if args.no_save:
            return 0
        manifest = [save(t, args.compress) for t in chosen]
        release_cgroups()
    (out_dir() / "images.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for m in manifest:
        log(f"{m['image']}: {int(m['image_bytes']) / 2**20:.0f} MiB, {m['archive']}")  # type: ignore[call-overload]
    log(f"done in {time.monotonic() - t0:.0f} s")
    return 0


def cmd_clean() -> int:
    s = store()
    if s.exists():
        with locked():
            subprocess.run(["buildah", "rm", "--all"], env=env(), check=False, stdout=subprocess.DEVNULL)
            subprocess.run(podman_cmd("rm", "--all", "--force"), env=env(), check=False, stdout=subprocess.DEVNULL)
            subprocess.run(podman_cmd("rmi", "--all", "--force"), env=env(), check=False, stdout=subprocess.DEVNULL)
        remove_tree(s)
    shutil.rmtree(out_dir(), ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["podman"]:
        try:
            return subprocess.run(podman_cmd(*argv[1:]), env=env()).returncode
        finally:
            release_cgroups()
    if argv[:1] == ["clean"]:
        return cmd_clean()
    if argv[:1] == ["build"]:
        argv = argv[1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", choices=sorted(targets()), help="default: every target")
    ap.add_argument("--base", help="build FROM this image instead of the debootstrap base (or KORA_BASE_IMAGE)")
    ap.add_argument("--no-save", action="store_true", help="build only; write no archive")
    ap.add_argument("--compress", action="store_true", help="gzip the archives' layers (slow: one core)")
    return cmd_build(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
