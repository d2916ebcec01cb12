#!/usr/bin/env bash
# Builds the real control-plane binaries the e2e harness runs, from pinned Go module
# versions, into a cache outside the repository keyed by version. Reuses what is there.
#
#   etcd                                     go.etcd.io/etcd/server/v3   $ETCD_VERSION
#   kube-apiserver, kube-controller-manager,
#   kubectl                                  k8s.io/kubernetes           $KUBE_VERSION
#
# Output: $REPLICATOR_CACHE/bin/etcd-$ETCD_VERSION/etcd and
#         $REPLICATOR_CACHE/bin/kubernetes-$KUBE_VERSION/{kube-apiserver,kube-controller-manager,kubectl}
# Recipe: ../shared/reference/karmada.md §1 (wrapper modules with the staging replace lines).
set -euo pipefail

KUBE_VERSION="${KUBE_VERSION:-v1.35.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
CACHE="${REPLICATOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/replicator}"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod

log() { printf '[build-control-plane %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

build_etcd() {
  local out="$CACHE/bin/etcd-$ETCD_VERSION"
  if [[ -x "$out/etcd" ]]; then log "etcd $ETCD_VERSION: cached at $out"; return; fi
  local work="$CACHE/src/etcd-$ETCD_VERSION"
  rm -rf "$work" && mkdir -p "$work" "$out.tmp"
  log "etcd $ETCD_VERSION: resolving modules (a few minutes cold)"
  (cd "$work" && go mod init replicator.local/etcd-build >/dev/null 2>&1 \
    && go get -tool "go.etcd.io/etcd/server/v3@$ETCD_VERSION" \
    && log "etcd $ETCD_VERSION: compiling" \
    && go build -trimpath -ldflags "-s -w" -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3)
  rm -rf "$out" && mv "$out.tmp" "$out"
  log "etcd $ETCD_VERSION: built at $out"
}

build_kubernetes() {
  local out="$CACHE/bin/kubernetes-$KUBE_VERSION"
  if [[ -x "$out/kube-apiserver" && -x "$out/kube-controller-manager" && -x "$out/kubectl" ]]; then
    log "kubernetes $KUBE_VERSION: cached at $out"; return
  fi
  local work="$CACHE/src/kubernetes-$KUBE_VERSION" staging_version="v0.${KUBE_VERSION#v1.}"
  local minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
  rm -rf "$work" && mkdir -p "$work" "$out.tmp"
  log "kubernetes $KUBE_VERSION: reading its go.mod for the staging modules"
  local modfile
  modfile=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
  {
    echo "module replicator.local/kubernetes-build"
    echo
    echo "go 1.25.0"
    echo
    echo "godebug default=go1.25"
    echo
    grep -E '^[[:space:]]*k8s\.io/[a-z0-9.-]+ v0\.0\.0[[:space:]]*$' "$modfile" | awk '{print $1}' | sort -u |
      while read -r m; do echo "replace $m => $m $staging_version"; done
  } >"$work/go.mod"
  log "kubernetes $KUBE_VERSION: $(grep -c '^replace' "$work/go.mod") staging replaces to $staging_version; resolving modules (several minutes cold)"
  (cd "$work" && for cmd in kube-apiserver kube-controller-manager kubectl; do
      go get -tool "k8s.io/kubernetes/cmd/$cmd@$KUBE_VERSION"
    done)
  local v="k8s.io/component-base/version" cv="k8s.io/client-go/pkg/version"
  local ld="-s -w"
  for p in "$v" "$cv"; do
    ld="$ld -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  for cmd in kube-apiserver kube-controller-manager kubectl; do
    log "kubernetes $KUBE_VERSION: compiling $cmd (the first one takes longest on 2 cores)"
    (cd "$work" && go build -trimpath -ldflags "$ld" -o "$out.tmp/$cmd" "k8s.io/kubernetes/cmd/$cmd")
  done
  rm -rf "$out" && mv "$out.tmp" "$out"
  log "kubernetes $KUBE_VERSION: built at $out"
}

mkdir -p "$CACHE/bin"
start=$(date +%s)
build_etcd
build_kubernetes
log "done in $(( $(date +%s) - start ))s; cache: $CACHE"
