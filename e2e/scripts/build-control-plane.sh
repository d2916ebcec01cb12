#!/usr/bin/env bash
# Builds the real control-plane binaries the e2e harness runs, from pinned Go module
# versions, into a cache outside the repository keyed by version. Reuses what is there.
#
#   etcd                                     go.etcd.io/etcd/server/v3   $ETCD_VERSION
#   kube-apiserver, kube-controller-manager,
#   kube-scheduler, kubelet, kubectl         k8s.io/kubernetes           $KUBE_VERSION
#   karmada-{aggregated-apiserver,webhook,
#   controller-manager,scheduler}            github.com/karmada-io/karmada $KARMADA_VERSION
#   prometheus, promtool                     github.com/prometheus/prometheus $PROMETHEUS_VERSION
#
# Output: $REPLICATOR_CACHE/bin/etcd-$ETCD_VERSION/etcd,
#         $REPLICATOR_CACHE/bin/kubernetes-$KUBE_VERSION/{kube-apiserver,kube-controller-manager,
#           kube-scheduler,kubelet,kubectl}
#         $REPLICATOR_CACHE/bin/karmada-$KARMADA_VERSION/karmada-{aggregated-apiserver,webhook,
#           controller-manager,scheduler}, plus the manifests the harness installs, copied from
#           the module: crds/ (charts/karmada/_crds/bases, without the kustomization) and
#           webhook-configuration.yaml (artifacts/deploy).
#         $REPLICATOR_CACHE/bin/prometheus-$PROMETHEUS_VERSION/{prometheus,promtool} (the e2e
#           monitoring checks: promtool on the alert rules, a real Prometheus scraping the pods).
# How: each Go program is built from a wrapper module that requires its upstream module at the
# pinned version (Kubernetes' with replace lines for its staging modules, as upstream's own
# go.mod has them); Prometheus without its web UI assets, and with only the Kubernetes service
# discovery compiled in.
# Concurrent runs (two harnesses, a developer and a test) are serialised by a lock in the cache.
set -euo pipefail

KUBE_VERSION="${KUBE_VERSION:-v1.35.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
KARMADA_VERSION="${KARMADA_VERSION:-v1.18.2}"
# Prometheus 3.x tags its Go module v0.<major*100+minor>.<patch>: v0.316.0 is Prometheus 3.16.0.
PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v0.316.0}"
CACHE="${REPLICATOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/replicator}"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod

log() { printf '[build-control-plane %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

mkdir -p "$CACHE/bin"
exec 9>"$CACHE/.build.lock"
if ! flock -n 9; then
  log "another build holds $CACHE/.build.lock; waiting for it"
  flock 9
fi

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

# The cells are real one-node clusters (kubelet, scheduler), so the set grew from three.
KUBE_COMMANDS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)

build_kubernetes() {
  local out="$CACHE/bin/kubernetes-$KUBE_VERSION" cmd missing=()
  for cmd in "${KUBE_COMMANDS[@]}"; do [[ -x "$out/$cmd" ]] || missing+=("$cmd"); done
  if (( ${#missing[@]} == 0 )); then log "kubernetes $KUBE_VERSION: cached at $out"; return; fi
  local work="$CACHE/src/kubernetes-$KUBE_VERSION" staging_version="v0.${KUBE_VERSION#v1.}"
  local minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
  rm -rf "$work" "$out.tmp" && mkdir -p "$work" "$out.tmp"
  # Keep what an older cache already has (a cache from before kubelet joined the set).
  for cmd in "${KUBE_COMMANDS[@]}"; do
    if [[ -x "$out/$cmd" ]]; then cp "$out/$cmd" "$out.tmp/"; fi
  done
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
  (cd "$work" && for cmd in "${missing[@]}"; do
      go get -tool "k8s.io/kubernetes/cmd/$cmd@$KUBE_VERSION"
    done)
  local v="k8s.io/component-base/version" cv="k8s.io/client-go/pkg/version"
  local ld="-s -w"
  for p in "$v" "$cv"; do
    ld="$ld -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  for cmd in "${missing[@]}"; do
    log "kubernetes $KUBE_VERSION: compiling $cmd (the first one takes longest on 2 cores)"
    (cd "$work" && go build -trimpath -ldflags "$ld" -o "$out.tmp/$cmd" "k8s.io/kubernetes/cmd/$cmd")
  done
  rm -rf "$out" && mv "$out.tmp" "$out"
  log "kubernetes $KUBE_VERSION: built at $out"
}

# The four Karmada components a push-mode control plane needs (karmada.md §2.3), installed as
# karmada-<cmd> so that `ps` tells them apart from kube-controller-manager.
KARMADA_COMMANDS=(aggregated-apiserver webhook controller-manager scheduler)

build_karmada() {
  local out="$CACHE/bin/karmada-$KARMADA_VERSION" cmd complete=1
  for cmd in "${KARMADA_COMMANDS[@]}"; do [[ -x "$out/karmada-$cmd" ]] || complete=0; done
  [[ -f "$out/webhook-configuration.yaml" && -d "$out/crds" ]] || complete=0
  if (( complete )); then log "karmada $KARMADA_VERSION: cached at $out"; return; fi
  local module="github.com/karmada-io/karmada" work="$CACHE/src/karmada-$KARMADA_VERSION"
  rm -rf "$work" "$out.tmp" && mkdir -p "$work" "$out.tmp/crds"
  # Karmada's go.mod has no replace lines, but `go install …@version` still fails here: it asks
  # the proxy for the module's version list (deprecation check), which the proxy refuses for
  # this module. A wrapper module requiring the tag resolves exactly Karmada's own requirements.
  # Its `go` line too, which sets the GODEBUG defaults as in Karmada's own build.
  local download modfile go_line
  download=$(go mod download -json "$module@$KARMADA_VERSION")
  modfile=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p' <<<"$download")
  go_line=$(sed -n 's/^go \([0-9.]*\).*$/\1/p' "$modfile")
  printf 'module replicator.local/karmada-build\n\ngo %s\n\nrequire %s %s\n' \
    "${go_line:-1.25.0}" "$module" "$KARMADA_VERSION" >"$work/go.mod"
  log "karmada $KARMADA_VERSION: resolving modules (several minutes cold)"
  (cd "$work" && for cmd in "${KARMADA_COMMANDS[@]}"; do
      go get -tool "$module/cmd/$cmd@$KARMADA_VERSION"
    done)
  local info dir commit
  info=$(cd "$work" && go list -m -json "$module")
  dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p' <<<"$info")
  [[ -d "$dir" ]] || { log "karmada $KARMADA_VERSION: go list reported no module directory"; exit 1; }
  commit=$(sed -n 's/^[[:space:]]*"Hash": "\(.*\)",*$/\1/p' <<<"$download")
  # CRDs from charts/karmada/_crds/bases only: the kustomization next to it patches in a
  # conversion webhook with placeholders (karmada.md §2.4).
  local crd
  while IFS= read -r crd; do
    cp "$crd" "$out.tmp/crds/$(basename "$(dirname "$crd")")_$(basename "$crd")"
  done < <(find "$dir/charts/karmada/_crds/bases" -name '*.yaml' | sort)
  cp "$dir/artifacts/deploy/webhook-configuration.yaml" "$out.tmp/"
  chmod -R u+w "$out.tmp"
  local v="$module/pkg/version"
  local ld="-s -w -X $v.gitVersion=$KARMADA_VERSION -X $v.gitTreeState=clean"
  [[ -n "$commit" ]] && ld="$ld -X $v.gitCommit=$commit -X $v.gitShortCommit=${commit:0:9}"
  for cmd in "${KARMADA_COMMANDS[@]}"; do
    log "karmada $KARMADA_VERSION: compiling $cmd (the first one takes longest on 2 cores)"
    # v1.17/v1.18 need this tag with the k8s 1.35 libraries (karmada.md §2.2); harmless later.
    (cd "$work" && go build -trimpath -tags kubernetes_protomessage_one_more_release \
      -ldflags "$ld" -o "$out.tmp/karmada-$cmd" "$module/cmd/$cmd")
  done
  rm -rf "$out" && mv "$out.tmp" "$out"
  log "karmada $KARMADA_VERSION: built at $out"
}

PROMETHEUS_COMMANDS=(prometheus promtool)
# Only the service discovery the tests use (Prometheus's plugins/ files are selected by these
# tags): without the cloud providers' SDKs the compile takes about half as long.
PROMETHEUS_TAGS=remove_all_sd,enable_kubernetes_sd

# The release a module version stands for: v0.316.0 -> 3.16.0.
prometheus_release() {
  local v="${1#v0.}" minor patch
  minor="${v%%.*}" patch="${v#*.}"
  [[ "$minor" =~ ^[0-9]+$ && "$patch" =~ ^[0-9]+$ ]] || { log "prometheus: cannot read a release from module version $1"; exit 1; }
  printf '%d.%d.%d' $(( minor / 100 )) $(( minor % 100 )) "$patch"
}

build_prometheus() {
  local out="$CACHE/bin/prometheus-$PROMETHEUS_VERSION" cmd complete=1
  for cmd in "${PROMETHEUS_COMMANDS[@]}"; do [[ -x "$out/$cmd" ]] || complete=0; done
  if (( complete )); then log "prometheus $PROMETHEUS_VERSION: cached at $out"; return; fi
  local module="github.com/prometheus/prometheus" work="$CACHE/src/prometheus-$PROMETHEUS_VERSION"
  local release t0
  release=$(prometheus_release "$PROMETHEUS_VERSION")
  rm -rf "$work" "$out.tmp" && mkdir -p "$work" "$out.tmp"
  t0=$(date +%s)
  log "prometheus $PROMETHEUS_VERSION ($release): resolving modules (a minute or two cold)"
  # A wrapper module, as for Karmada: `go get -tool` resolves exactly Prometheus's requirements
  # (and raises the wrapper's `go` line to Prometheus's own).
  (cd "$work" && go mod init replicator.local/prometheus-build >/dev/null 2>&1 \
    && for cmd in "${PROMETHEUS_COMMANDS[@]}"; do
      go get -tool "$module/cmd/$cmd@$PROMETHEUS_VERSION"
    done)
  # Without these `--version` prints an empty version. The module ships no built web UI: the
  # HTTP API, scraping and rule evaluation work, `/query` in a browser does not (prometheus.md).
  local v="github.com/prometheus/common/version"
  # (The proxy's module info carries no commit, so Revision stays "unknown".)
  local ld="-s -w -X $v.Version=$release -X $v.Branch=HEAD -X $v.BuildUser=replicator-e2e"
  log "prometheus $PROMETHEUS_VERSION: modules resolved in $(( $(date +%s) - t0 ))s"
  for cmd in "${PROMETHEUS_COMMANDS[@]}"; do
    t0=$(date +%s)
    log "prometheus $PROMETHEUS_VERSION: compiling $cmd (the first one takes longest on 2 cores)"
    (cd "$work" && go build -trimpath -tags "$PROMETHEUS_TAGS" -ldflags "$ld" -o "$out.tmp/$cmd" "$module/cmd/$cmd")
    log "prometheus $PROMETHEUS_VERSION: $cmd compiled in $(( $(date +%s) - t0 ))s"
  done
  rm -rf "$out" && mv "$out.tmp" "$out"
  log "prometheus $PROMETHEUS_VERSION: built at $out"
}

start=$(date +%s)
build_etcd
build_kubernetes
build_karmada
build_prometheus
log "done in $(( $(date +%s) - start ))s; cache: $CACHE"
