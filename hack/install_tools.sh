#!/usr/bin/env bash
# Debian packages the tests need beyond Python, installed only where the machine lacks them:
#   strace      the loopback tests (tests/e2e/test_loopback_only.py, hack/nettrace.py)
#   iproute2    `ip netns` / veth for the two-node Ray tests (hack/netns_cluster.py, tests/e2e/test_train_two_nodes.py)
#   containerd, runc, containernetworking-plugins, iptables
#               the real node (hack/localnode.py, `hack/localcluster.py up --node`, tests/integration/test_localnode.py)
#   gcc, libc6-dev  its pause image, a static C program (gcc -static)
#   buildah, podman, debootstrap
#               kora's images without a Docker engine or a registry (hack/images.py, tests/e2e/test_images.py):
#               debootstrap makes the Debian base, buildah builds the Dockerfile, podman imports, runs and saves
set -euo pipefail
missing=()
command -v strace >/dev/null || missing+=(strace)
command -v ip >/dev/null || missing+=(iproute2)
for tool in containerd runc iptables gcc buildah podman debootstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
[ -x /usr/lib/cni/bridge ] || [ -x /opt/cni/bin/bridge ] || missing+=(containernetworking-plugins)
compgen -G "/usr/lib/*/libc.a" >/dev/null || missing+=(libc6-dev)
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "[setup] installing ${missing[*]} (apt)" >&2
# another installer may hold dpkg's lock: wait for it rather than fail
lock=(-o DPkg::Lock::Timeout=600)
$sudo apt-get update -qq "${lock[@]}"
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${lock[@]}" "${missing[@]}" >/dev/null
for tool in strace ip containerd runc iptables gcc buildah podman debootstrap; do
    command -v "$tool" >/dev/null || { echo "[setup] $tool still missing after apt-get install" >&2; exit 1; }
done
