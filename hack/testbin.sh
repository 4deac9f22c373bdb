#!/usr/bin/env bash
# Provide the pinned test binaries (etcd, kube-apiserver, kube-controller-manager, kubectl,
# helm, KubeRay's ray-operator) and KubeRay's CRDs, built once from the Go module proxy into
# ~/.cache/kora-testbin/<versions> and reused. Prints that directory on its last line.
#
# KORA_TESTBIN=/some/dir skips the build and uses binaries already there (same file names).
#
# Why wrappers: k8s.io/kubernetes and etcd's server module carry `replace` directives, so
# `go install mod@ver` refuses them; a throwaway module that requires them (and maps every
# k8s.io staging module to its published v0.Y.Z tag) builds the real commands unchanged.
#
# `hack/testbin.sh --node` provides, in a cache dir of its own (so the control-plane cache above
# stays valid), what a real node adds: kubelet, kube-scheduler, kube-proxy (same wrapper module)
# and CoreDNS (`go install`, its own module). hack/localnode.py uses it. KORA_NODEBIN=/some/dir
# skips that build the same way KORA_TESTBIN does.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
log() { echo "[testbin] $*" >&2; }

# k8s_build DEST CMD...: build k8s.io/kubernetes/cmd/<CMD> at $KUBERNETES_VERSION into DEST through
# a throwaway wrapper module (see above); run inside an empty work dir.
k8s_build() {
  local dest=$1; shift
  go mod init kora.dev/testbin/k8s >/dev/null 2>&1
  local kdir staging_ver
  kdir=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  staging_ver="v0.${KUBERNETES_VERSION#v1.}"
  {
    echo "require k8s.io/kubernetes $KUBERNETES_VERSION"
    # every `k8s.io/x => ./staging/src/k8s.io/x` replace in kubernetes' go.mod -> published tag
    grep -oE '^\s*k8s.io/[a-z0-9./-]+ => \./staging' "$kdir/go.mod" | awk '{print "replace " $1 " => " $1 " '"$staging_ver"'"}'
  } >> go.mod
  {
    printf '//go:build tools\n\npackage tools\n\nimport (\n'
    for cmd in "$@"; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$cmd"; done
    printf ')\n'
  } > tools.go
  # the requirement on k8s.io/kubernetes brings its own dependency versions (MVS), so the build
  # matches the release; only its replaces had to be restated above
  go mod tidy -e >/dev/null 2>&1 || true
  go mod tidy >&2
  local vpkg=k8s.io/component-base/version ld
  ld="-s -w -X $vpkg.gitVersion=$KUBERNETES_VERSION -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$(echo "$KUBERNETES_VERSION" | cut -d. -f2) -X $vpkg.gitTreeState=clean"
  ld="$ld -X k8s.io/client-go/pkg/version.gitVersion=$KUBERNETES_VERSION"
  for cmd in "$@"; do
    log "go build $cmd"
    go build -tags tools -ldflags "$ld" -o "$dest/.$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd"
    mv -f "$dest/.$cmd.tmp" "$dest/$cmd"
  done
}

# lock_dest DEST: one build of DEST at a time; a second caller waits for the first.
lock_dest() {
  exec 9>"$1.lock"
  if ! flock -n 9; then
    log "another hack/testbin.sh is building $1; waiting for it"
    flock 9
  fi
}

if [[ "${1:-}" == "--node" ]]; then
  node_bins=(kubelet kube-scheduler kube-proxy coredns)
  if [[ -n "${KORA_NODEBIN:-}" ]]; then
    for b in "${node_bins[@]}"; do
      [[ -x "$KORA_NODEBIN/$b" ]] || { echo "KORA_NODEBIN=$KORA_NODEBIN lacks $b" >&2; exit 1; }
    done
    echo "$KORA_NODEBIN"; exit 0
  fi
  dest="${XDG_CACHE_HOME:-$HOME/.cache}/kora-testbin/node-k8s-${KUBERNETES_VERSION}_coredns-${COREDNS_VERSION}"
  if [[ -f "$dest/.complete" ]]; then echo "$dest"; exit 0; fi
  mkdir -p "$dest"
  lock_dest "$dest"
  if [[ -f "$dest/.complete" ]]; then echo "$dest"; exit 0; fi
  export GOFLAGS="-buildvcs=false" CGO_ENABLED=0
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  t0=$SECONDS
  if [[ ! -x "$dest/kubelet" || ! -x "$dest/kube-scheduler" || ! -x "$dest/kube-proxy" ]]; then
    log "building kubelet, kube-scheduler, kube-proxy $KUBERNETES_VERSION (cold: many minutes on 2 cores)"
    mkdir -p "$work/k8s" && cd "$work/k8s"
    k8s_build "$dest" kubelet kube-scheduler kube-proxy
  fi
  if [[ ! -x "$dest/coredns" ]]; then
    log "building CoreDNS $COREDNS_VERSION"
    GOBIN="$work/bin" go install -ldflags "-s -w" "github.com/coredns/coredns@$COREDNS_VERSION"
    cp "$work/bin/coredns" "$dest/.coredns.tmp" && mv -f "$dest/.coredns.tmp" "$dest/coredns"
  fi
  touch "$dest/.complete"
  log "node binaries done in $((SECONDS - t0)) s"
  echo "$dest"
  exit 0
fi

if [[ -n "${KORA_TESTBIN:-}" ]]; then
  for b in etcd kube-apiserver kube-controller-manager kubectl helm ray-operator; do
    [[ -x "$KORA_TESTBIN/$b" ]] || { echo "KORA_TESTBIN=$KORA_TESTBIN lacks $b" >&2; exit 1; }
  done
  compgen -G "$KORA_TESTBIN/kuberay-crds/*.yaml" >/dev/null \
    || { echo "KORA_TESTBIN=$KORA_TESTBIN lacks kuberay-crds/*.yaml" >&2; exit 1; }
  echo "$KORA_TESTBIN"; exit 0
fi

key="k8s-${KUBERNETES_VERSION}_etcd-${ETCD_VERSION}_helm-${HELM_VERSION}_kuberay-${KUBERAY_VERSION}"
dest="${XDG_CACHE_HOME:-$HOME/.cache}/kora-testbin/$key"
if [[ -f "$dest/.complete" ]]; then echo "$dest"; exit 0; fi
mkdir -p "$dest"
# One build at a time: a second caller (another shell, pytest next to `localcluster.py up`) waits
# for the first and then finds the result complete.
lock_dest "$dest"
if [[ -f "$dest/.complete" ]]; then echo "$dest"; exit 0; fi
export GOFLAGS="-buildvcs=false" CGO_ENABLED=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
t0=$SECONDS

# --- Kubernetes: kube-apiserver, kube-controller-manager, kubectl -------------------------
if [[ ! -x "$dest/kube-apiserver" || ! -x "$dest/kube-controller-manager" || ! -x "$dest/kubectl" ]]; then
  log "building Kubernetes $KUBERNETES_VERSION (cold: ~15-30 min on 2 cores)"
  mkdir -p "$work/k8s" && cd "$work/k8s"
  k8s_build "$dest" kube-apiserver kube-controller-manager kubectl
fi

# --- etcd ----------------------------------------------------------------------------------
if [[ ! -x "$dest/etcd" ]]; then
  log "building etcd $ETCD_VERSION"
  mkdir -p "$work/etcd" && cd "$work/etcd"
  go mod init kora.dev/testbin/etcd >/dev/null 2>&1
  printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' > tools.go
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2
  go mod tidy >&2
  go build -ldflags "-s -w" -o "$dest/.etcd.tmp" go.etcd.io/etcd/server/v3
  mv -f "$dest/.etcd.tmp" "$dest/etcd"
fi

# --- helm and KubeRay (plain go install works for these) ------------------------------------
if [[ ! -x "$dest/helm" ]]; then
  log "building helm $HELM_VERSION"
  GOBIN="$work/bin" go install -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  cp "$work/bin/helm" "$dest/.helm.tmp" && mv -f "$dest/.helm.tmp" "$dest/helm"
fi
if [[ ! -x "$dest/ray-operator" ]]; then
  log "building KubeRay ray-operator $KUBERAY_VERSION"
  GOBIN="$work/bin" go install -ldflags "-s -w" "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION"
  cp "$work/bin/ray-operator" "$dest/.ray-operator.tmp" && mv -f "$dest/.ray-operator.tmp" "$dest/ray-operator"
fi
rdir=$(cd "$work" && go mod download -json "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
mkdir -p "$dest/kuberay-crds"
cp "$rdir"/config/crd/bases/*.yaml "$dest/kuberay-crds/"
chmod u+w "$dest/kuberay-crds/"*.yaml

touch "$dest/.complete"
log "done in $((SECONDS - t0)) s"
echo "$dest"
