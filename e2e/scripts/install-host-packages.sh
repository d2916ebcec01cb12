#!/usr/bin/env bash
# Installs the Debian packages the cells' one-node clusters need, when one is missing:
#   containerd (1.6, Debian 12's: pinned by the distribution and built with the CRI plugin;
#   building containerd from its Go module would add minutes to a cold run for no gain here),
#   runc, containernetworking-plugins (bridge, host-local, loopback in /usr/lib/cni), iptables
#   (the DNAT rule that stands in for kube-proxy), iproute2 (`ip`), buildah (the image build).
# Runs as root (CI does); prints nothing when everything is there.
set -euo pipefail

declare -A need=(
  [/usr/bin/containerd]=containerd
  [/usr/sbin/runc]=runc
  [/usr/lib/cni/bridge]=containernetworking-plugins
  [/usr/sbin/iptables]=iptables
  [/usr/sbin/ip]=iproute2
  [/usr/bin/buildah]=buildah
)
missing=()
for path in "${!need[@]}"; do
  [[ -e $path ]] || missing+=("${need[$path]}")
done
(( ${#missing[@]} == 0 )) && exit 0
if (( EUID != 0 )); then
  echo "[install-host-packages] missing ${missing[*]}: run as root, or: apt-get install -y ${missing[*]}" >&2
  exit 1
fi
echo "[install-host-packages $(date +%H:%M:%S)] installing ${missing[*]} with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
