#!/usr/bin/env bash
# Debian packages the tests need beyond Python, installed only where the machine lacks them:
#   strace   the loopback tests (tests/e2e/test_loopback_only.py, hack/nettrace.py)
#   iproute2 `ip netns` / veth for the two-node Ray tests (hack/netns_cluster.py, tests/e2e/test_train_two_nodes.py)
set -euo pipefail
missing=()
command -v strace >/dev/null || missing+=(strace)
command -v ip >/dev/null || missing+=(iproute2)
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "[setup] installing ${missing[*]} (apt)" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
command -v strace >/dev/null && command -v ip >/dev/null
