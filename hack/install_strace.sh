#!/usr/bin/env bash
# strace for the loopback tests (tests/e2e/test_loopback_only.py, hack/nettrace.py): Debian's package,
# installed only where the machine lacks it.
set -euo pipefail
command -v strace >/dev/null && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "[setup] installing strace (apt)" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends strace >/dev/null
command -v strace >/dev/null
