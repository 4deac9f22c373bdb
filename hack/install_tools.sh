#!/usr/bin/env bash
# Debian packages the tests need beyond Python, installed only where the machine lacks them:
#   strace   the loopback tests (tests/e2e/test_loopback_only.py, hack/nettrace.py)
#   iproute2 `ip netns` / veth for the two-node Ray tests (hack/netns_cluster.py, tests/e2e/test_train_two_nodes.py)
#   containerd, runc, containernetworking-plugins, iptables
#            the real node (hack/localnode.py, `hack/localcluster.py up --node`, tests/integration/test_localnode.py)
#   gcc, libc6-dev  its pause image, a static C program (gcc -static)
set -euo pipefail
missing=()
command -v strace >/dev/null || missing+=(strace)
command -v ip >/dev/null || missing+=(iproute2)
command -v containerd >/dev/null || missing+=(containerd)
command -v runc >/dev/null || missing+=(runc)
[ -x /usr/lib/cni/bridge ] || [ -x /opt/cni/bin/bridge ] || missing+=(containernetworking-plugins)
command -v iptables >/dev/null || missing+=(iptables)
command -v gcc >/dev/null || missing+=(gcc)
compgen -G "/usr/lib/*/libc.a" >/dev/null || missing+=(libc6-dev)
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "[setup] installing ${missing[*]} (apt)" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
command -v strace >/dev/null && command -v ip >/dev/null && command -v containerd >/dev/null
