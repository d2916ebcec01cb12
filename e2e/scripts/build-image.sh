#!/usr/bin/env bash
# Builds the replicator's container image from the repository's Dockerfile, and a pause image for
# the kubelets' pod sandboxes, without any registry: both bases are assembled from this host.
#
#   localhost/replicator-base:<hash>   from scratch: the shared libraries `ldd` names for the binary
#                                      (and the dynamic loader), CA certificates, /etc/passwd and
#                                      /etc/group with nonroot (65532), /tmp; <hash> of its content.
#                                      Stands in for gcr.io/distroless/cc-debian12:nonroot.
#   localhost/replicator:<sha>         `buildah bud` of ./Dockerfile on that base; <sha> is the first
#                                      12 hex digits of the binary's sha256.
#   localhost/pause:<version>-<hash>   e2e/scripts/pause.c, static, alone in the image.
#
# Each is reused when its tag exists, so a run with nothing changed builds nothing. Older
# replicator images beyond the newest $REPLICATOR_KEEP_IMAGES (default 3) are removed.
# Output, in $REPLICATOR_IMAGES_DIR (default target/images/): replicator.tar and pause.tar, and
# images.env:
#   REPLICATOR_IMAGE=localhost/replicator:<sha>
#   PAUSE_IMAGE=localhost/pause:<version>-<hash>
# The archives are docker archives (`docker save` format): their manifest.json names the image
# (RepoTags), and containerd 1.6's `ctr -n k8s.io images import` keeps that name. An OCI archive
# keeps it only when its org.opencontainers.image.ref.name holds the full name; with a bare tag,
# the OCI convention, ctr names the image import-<date>:<tag>. Docker archives also carry the layers
# uncompressed: no gzip on writing or importing (25 MB on disk rather than 9).
#
# Environment: REPLICATOR_BINARY  a built binary to ship (default: cargo build --release --locked)
#              REPLICATOR_CACHE   cache root (default ${XDG_CACHE_HOME:-~/.cache}/replicator); the
#                                 image store is its buildah/ (vfs driver: nothing in /var/lib/containers)
# Installs buildah (and gcc, libc6-dev for pause.c) with apt-get when missing: run as root.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${REPLICATOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/replicator}"
OUT="${REPLICATOR_IMAGES_DIR:-$ROOT/target/images}"
STORE="$CACHE/buildah"
PAUSE_SRC="$ROOT/e2e/scripts/pause.c"
PAUSE_CFLAGS=(-static -Os -s)

log() { printf '[build-image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

((EUID == 0)) || die "run as root: buildah (vfs) runs in a private mount namespace"
mkdir -p "$STORE" "$OUT"
exec 9>"$CACHE/.image.lock"
if ! flock -n 9; then
  log "another build holds $CACHE/.image.lock; waiting for it"
  flock 9
fi

APT_UPDATED=
apt_install() {
  ((EUID == 0)) || die "missing $*: install it (apt-get install -y $*) or run as root"
  log "installing $* with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  if [[ -z $APT_UPDATED ]]; then apt-get update -qq >&2 && APT_UPDATED=1; fi
  apt-get install -y -qq --no-install-recommends "$@" >&2
}

command -v buildah >/dev/null || apt_install buildah

# Accepts any image: everything here is local, nothing is pulled.
POLICY="$STORE/policy.json"
[[ -f $POLICY ]] || printf '{"default":[{"type":"insecureAcceptAnything"}]}\n' >"$POLICY"
# buildah 1.28 as root writes outside --root and --runroot, with no flag to move either: every image
# write (commit, bud, push) opens a blob-info cache in /var/lib/containers/cache, every command
# creates /run/containers/networks. So it runs in a private mount namespace (nothing propagates
# out) whose /var/lib is $STORE/var-lib and whose /run is an empty tmpfs, gone when it exits.
# vfs needs no mounts of its own: its layers are plain directories, visible outside.
mkdir -p "$STORE/var-lib"
bah() {
  unshare --mount --propagation private -- sh -c \
    'mount --bind "$1" /var/lib && mount -t tmpfs -o mode=0755 buildah-run /run && shift && exec buildah "$@"' \
    sh "$STORE/var-lib" --root "$STORE/root" --runroot "$STORE/run" --storage-driver vfs "$@"
}
image_exists() { bah inspect --type image "$1" >/dev/null 2>&1; }

# Working containers and staging directories to remove on exit.
CONTAINERS=() TEMPS=()
cleanup() {
  local c
  for c in "${CONTAINERS[@]}"; do bah rm "$c" >/dev/null 2>&1 || true; done
  ((${#TEMPS[@]} == 0)) || rm -rf "${TEMPS[@]}"
}
trap cleanup EXIT
new_container() { # prints the name of a working container from scratch
  local c
  c=$(bah from --signature-policy "$POLICY" --pull=never scratch)
  CONTAINERS+=("$c")
  echo "$c"
}
tempdir() { mktemp -d "$STORE/tmp.XXXXXX"; }

# --- the binary -------------------------------------------------------------------------------
if [[ -n ${REPLICATOR_BINARY:-} ]]; then
  BINARY="$(realpath "$REPLICATOR_BINARY")"
  [[ -x $BINARY ]] || die "REPLICATOR_BINARY=$REPLICATOR_BINARY is not an executable"
  log "binary: $BINARY (REPLICATOR_BINARY)"
else
  log "cargo build --release --locked -p replicator --bin replicator"
  BINARY=$(cd "$ROOT" && cargo build --release --locked -p replicator --bin replicator \
    --message-format=json-render-diagnostics \
    | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
  [[ -n $BINARY && -x $BINARY ]] || die "cargo named no replicator executable"
fi
# The build context is the repository (.dockerignore lets the two paths below through).
if [[ $BINARY == "$ROOT/target/release/replicator" ]]; then
  BINARY_IN_CONTEXT=target/release/replicator
else
  BINARY_IN_CONTEXT=target/image/replicator
  mkdir -p "$ROOT/target/image"
  cmp -s "$BINARY" "$ROOT/$BINARY_IN_CONTEXT" || cp "$BINARY" "$ROOT/$BINARY_IN_CONTEXT"
fi
BINARY_SHA=$(sha256sum "$BINARY" | cut -c1-12)
VERSION_LINE=$("$BINARY" --version 2>/dev/null || true)
log "binary: $VERSION_LINE, sha256 $BINARY_SHA"

# --- base: the host's libraries, from scratch ---------------------------------------------------
# Copies host path $1 into the root $2, recreating each symlink on the way (a directory link such
# as /lib -> usr/lib, a library's soname link) and then what it points to.
copy_host_path() {
  local path=$1 root=$2 prefix="" part target
  local -a parts
  IFS=/ read -ra parts <<<"${path#/}"
  local i
  for ((i = 0; i < ${#parts[@]}; i++)); do
    part=${parts[i]}
    [[ -n $part ]] || continue
    prefix+="/$part"
    if [[ -L $prefix ]]; then
      target=$(readlink "$prefix")
      if [[ ! -L $root$prefix ]]; then
        mkdir -p "$root$(dirname "$prefix")"
        ln -s "$target" "$root$prefix"
      fi
      [[ $target == /* ]] || target="$(dirname "$prefix")/$target"
      local rest=("${parts[@]:i+1}")
      copy_host_path "$(realpath -ms "$target")$( ((${#rest[@]})) && printf '/%s' "${rest[@]}")" "$root"
      return
    fi
  done
  [[ -e $root$prefix ]] && return
  if [[ -d $prefix ]]; then mkdir -p "$root$prefix"; return; fi
  mkdir -p "$root$(dirname "$prefix")"
  cp -p "$prefix" "$root$prefix"
}

# The libraries the binary loads, with the loader; nothing for a static binary.
libraries_of() {
  local out
  if ! out=$(ldd "$1" 2>&1); then
    [[ $out == *"not a dynamic executable"* || $out == *"statically linked"* ]] && return
    die "ldd $1: $out"
  fi
  [[ $out != *"not found"* ]] || die "ldd $1: a library is missing: $out"
  awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$out" | sort -u
}

BASE_CONFIG=(--user 65532:65532 --workingdir /
  --env PATH=/usr/local/bin:/usr/bin:/bin --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
  --label org.opencontainers.image.title=replicator-base
  --label "org.opencontainers.image.description=glibc, CA certificates and nonroot from the build host")

build_base() {
  local root lib hash
  root=$(tempdir); TEMPS+=("$root")
  for lib in $(libraries_of "$BINARY"); do copy_host_path "$lib" "$root"; done
  install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' \
    'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$root/etc/passwd"
  printf '%s\n' 'root:x:0:' 'nonroot:x:65532:' >"$root/etc/group"
  printf '%s\n' 'passwd: files' 'group: files' 'hosts: files dns' >"$root/etc/nsswitch.conf"
  chmod 0644 "$root"/etc/{passwd,group,nsswitch.conf}
  install -d -m 0700 -o 65532 -g 65532 "$root/home/nonroot"
  install -d -m 1777 "$root/tmp"
  install -d -m 0700 "$root/root"
  # The tag hashes what goes in: files, modes, owners, links, and the image config.
  hash=$({ tar --sort=name --mtime=@0 --numeric-owner -C "$root" -cf - . && printf '%s\n' "${BASE_CONFIG[@]}"; } \
    | sha256sum | cut -c1-12)
  BASE_IMAGE="localhost/replicator-base:$hash"
  if image_exists "$BASE_IMAGE"; then log "base: $BASE_IMAGE exists, reused"; return; fi
  log "base: building $BASE_IMAGE ($(du -sh "$root" | cut -f1) from the host)"
  local c mnt
  c=$(new_container)
  mnt=$(bah mount "$c")
  tar --numeric-owner -C "$root" -cf - . | tar --numeric-owner -p -C "$mnt" -xf -
  bah umount "$c" >/dev/null
  bah config "${BASE_CONFIG[@]}" "$c"
  bah commit --quiet --rm "$c" "$BASE_IMAGE" >/dev/null
  log "base: built $BASE_IMAGE"
}

# --- pause -------------------------------------------------------------------------------------
build_pause() {
  local version hash
  version=$(sed -n 's/^#define VERSION "\(.*\)"$/\1/p' "$PAUSE_SRC")
  [[ -n $version ]] || die "$PAUSE_SRC: no #define VERSION"
  hash=$({ cat "$PAUSE_SRC" && printf '%s\n' "${PAUSE_CFLAGS[@]}"; } | sha256sum | cut -c1-8)
  PAUSE_IMAGE="localhost/pause:$version-$hash"
  if image_exists "$PAUSE_IMAGE"; then log "pause: $PAUSE_IMAGE exists, reused"; return; fi
  local need=()
  command -v cc >/dev/null || need+=(gcc)
  # Without libc6-dev (libc.a), cc prints the bare name back.
  [[ $(cc -print-file-name=libc.a 2>/dev/null || true) == /* ]] || need+=(libc6-dev)
  ((${#need[@]} == 0)) || apt_install "${need[@]}"
  local dir c
  dir=$(tempdir); TEMPS+=("$dir")
  cc "${PAUSE_CFLAGS[@]}" -o "$dir/pause" "$PAUSE_SRC"
  c=$(new_container)
  bah copy --quiet "$c" "$dir/pause" /pause >/dev/null
  # As registry.k8s.io/pause: nobody's UID, the program as the entrypoint.
  bah config --user 65535:65535 --entrypoint '["/pause"]' \
    --label org.opencontainers.image.title=pause "$c"
  bah commit --quiet --rm "$c" "$PAUSE_IMAGE" >/dev/null
  log "pause: built $PAUSE_IMAGE"
}

# --- replicator --------------------------------------------------------------------------------
build_replicator() {
  local source revision inputs label=io.replicator.build-inputs
  source=$(git -C "$ROOT" remote get-url origin 2>/dev/null || true)
  revision=$(sed -n 's/.*(commit \([0-9a-f]*\)).*/\1/p' <<<"$VERSION_LINE")
  # The tag follows the binary; the label catches a changed base or Dockerfile under the same tag.
  inputs=$(cat "$ROOT/Dockerfile" "$ROOT/.dockerignore" <(printf '%s\n' "$BASE_IMAGE" "$source") \
    | sha256sum | cut -c1-12)
  REPLICATOR_IMAGE="localhost/replicator:$BINARY_SHA"
  if image_exists "$REPLICATOR_IMAGE"; then
    if [[ $(bah inspect --type image --format "{{index .OCIv1.Config.Labels \"$label\"}}" \
      "$REPLICATOR_IMAGE") == "$inputs" ]]; then
      log "replicator: $REPLICATOR_IMAGE exists, reused"
      return
    fi
    log "replicator: $REPLICATOR_IMAGE exists from another base or Dockerfile; rebuilding"
  fi
  log "replicator: buildah bud -> $REPLICATOR_IMAGE"
  (cd "$ROOT" && bah bud --quiet --isolation chroot --pull=never --signature-policy "$POLICY" \
    --build-arg "BASE=$BASE_IMAGE" --build-arg "BINARY=$BINARY_IN_CONTEXT" \
    --build-arg "SOURCE=$source" --build-arg "REVISION=$revision" --label "$label=$inputs" \
    -t "$REPLICATOR_IMAGE" . >/dev/null)
  log "replicator: built $REPLICATOR_IMAGE"
}

# --- archives ----------------------------------------------------------------------------------
# Writes image $1 to $OUT/$2 as a docker archive named $1, unless that file already holds it.
write_archive() {
  local image=$1 file="$OUT/$2" id stamp
  id=$(bah inspect --type image --format '{{.FromImageID}}' "$image")
  stamp="$OUT/.$2.id"
  if [[ -f $file && -f $stamp && $(<"$stamp") == "$image $id" ]]; then
    log "archive: $file holds $image, kept"
    return
  fi
  rm -f "$file" "$file.tmp" "$stamp"
  bah push --quiet --signature-policy "$POLICY" "$image" "docker-archive:$file.tmp:$image" >/dev/null
  mv "$file.tmp" "$file"
  printf '%s %s\n' "$image" "$id" >"$stamp"
  log "archive: wrote $file"
}

# Removes replicator images beyond the newest $REPLICATOR_KEEP_IMAGES, bases no image uses any
# more, and untagged leftovers (an image rebuilt under its tag).
prune() {
  local keep=${REPLICATOR_KEEP_IMAGES:-3} image
  for image in $(bah images --noheading --format '{{.CreatedAtRaw}}|{{.Name}}:{{.Tag}}' \
    | awk -F'|' '$2 ~ /^localhost\/replicator:/' | sort -r | tail -n +$((keep + 1)) | cut -d'|' -f2); do
    [[ $image == "$REPLICATOR_IMAGE" ]] || { bah rmi "$image" >/dev/null && log "removed $image"; }
  done
  for image in $(bah images --noheading --format '{{.Name}}:{{.Tag}}' | grep '^localhost/replicator-base:'); do
    # A base still under a kept image is refused: it stays.
    [[ $image == "$BASE_IMAGE" ]] || { bah rmi "$image" >/dev/null 2>&1 && log "removed $image"; } || true
  done
  bah rmi --prune >/dev/null 2>&1 || true
}

build_base
build_pause
build_replicator
prune
write_archive "$REPLICATOR_IMAGE" replicator.tar
write_archive "$PAUSE_IMAGE" pause.tar
printf 'REPLICATOR_IMAGE=%s\nPAUSE_IMAGE=%s\n' "$REPLICATOR_IMAGE" "$PAUSE_IMAGE" >"$OUT/images.env.tmp"
mv "$OUT/images.env.tmp" "$OUT/images.env"

size_of() { # uncompressed: the sum of the layers' sizes in the archive
  tar -tvf "$OUT/$1" | awk '$6 ~ /\.tar$/ { s += $3 } END { printf "%.1f MB", s / 1e6 }'
}
log "wrote $OUT/images.env"
log "$PAUSE_IMAGE: $(size_of pause.tar)"
log "$REPLICATOR_IMAGE: $(size_of replicator.tar) uncompressed (binary $(du -m "$BINARY" | cut -f1) MB)"
