#!/usr/bin/env bash
# Build the MultiMesh image on a machine that reaches no image registry: the base image is
# debootstrapped from the Ubuntu archive (jammy; Debian bookworm if Ubuntu's archive is
# unreachable) and imported, the Docker engine is installed/started if none runs, and the
# host's CA bundle (SSL_CERT_FILE / PIP_CERT) is passed as a BuildKit secret when present.
#
#   docker/build-local.sh [--gpu] [--tag TAG] [--python python3.11]
#   docker/build-local.sh --engine-only    # start the engine; print the client's path
#
# Progress goes to stderr; the last line on stdout is the image tag.
set -euo pipefail
cd "$(dirname "$0")/.."

variant=cpu
tag=""
python=python3.11
engine_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) variant=cuda12; shift ;;
    --tag) tag=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --engine-only) engine_only=1; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "build-local.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$tag" ] || tag="multimesh-jax:local-${variant}"

UBUNTU_MIRROR=${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
UBUNTU_SECURITY=${UBUNTU_SECURITY:-http://security.ubuntu.com/ubuntu}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING_DEB=ubuntu-keyring_2021.03.26_all.deb
KEYRING_SHA256=0d0e7ed6b112f5d03eabf3c7eb01ebdacf9c57714b279e90495cfc58c8c4520f
# Debian's client (/usr/bin/docker) builds with the daemon's built-in BuildKit; other
# clients need the buildx plugin for DOCKER_BUILDKIT=1.
if [ -z "${DOCKER:-}" ]; then
  if [ -x /usr/bin/docker ] || ! docker buildx version >/dev/null 2>&1; then
    DOCKER=/usr/bin/docker
  else
    DOCKER=docker
  fi
fi
log() { echo "build-local: $*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

ensure_engine() {
  if "$DOCKER" info >/dev/null 2>&1; then return 0; fi
  if ! command -v dockerd >/dev/null 2>&1; then
    log "installing docker.io"
    as_root apt-get update -q >&2
    as_root apt-get install -y -q docker.io >&2
  fi
  local logfile=${DOCKERD_LOG:-/tmp/dockerd.log}
  log "starting dockerd (log: $logfile)"
  as_root nohup dockerd >"$logfile" 2>&1 &
  for _ in $(seq 60); do
    if "$DOCKER" info >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  log "the Docker engine did not start within 60 s; see $logfile"
  exit 1
}

ubuntu_keyring() {
  local k=/usr/share/keyrings/ubuntu-archive-keyring.gpg
  if [ -f "$k" ]; then echo "$k"; return 0; fi
  local dir=${XDG_CACHE_HOME:-$HOME/.cache}/multimesh-build
  mkdir -p "$dir"
  if [ ! -f "$dir/ubuntu-archive-keyring.gpg" ]; then
    curl -fsS -o "$dir/$KEYRING_DEB" "$UBUNTU_MIRROR/pool/main/u/ubuntu-keyring/$KEYRING_DEB" >&2
    echo "$KEYRING_SHA256  $dir/$KEYRING_DEB" | sha256sum -c - >&2
    dpkg-deb --fsys-tarfile "$dir/$KEYRING_DEB" \
      | tar -xO ./usr/share/keyrings/ubuntu-archive-keyring.gpg >"$dir/ubuntu-archive-keyring.gpg"
  fi
  echo "$dir/ubuntu-archive-keyring.gpg"
}

# Prints the name of a local base image, debootstrapping and importing it if missing.
ensure_base() {
  local name
  if command -v debootstrap >/dev/null 2>&1; then :; else
    log "installing debootstrap"
    as_root apt-get install -y -q debootstrap >&2
  fi
  if curl -fsS -o /dev/null --max-time 20 "$UBUNTU_MIRROR/dists/jammy/Release"; then
    name=multimesh-base:ubuntu-jammy
  else
    log "LOUD: the Ubuntu archive is unreachable; falling back to a Debian bookworm base"
    name=multimesh-base:debian-bookworm
  fi
  if "$DOCKER" image inspect "$name" >/dev/null 2>&1; then echo "$name"; return 0; fi
  local root
  root=$(mktemp -d /tmp/multimesh-rootfs.XXXXXX)
  log "debootstrapping $name into $root"
  if [ "$name" = multimesh-base:ubuntu-jammy ]; then
    as_root debootstrap --variant=minbase --components=main,universe \
      --keyring="$(ubuntu_keyring)" jammy "$root" "$UBUNTU_MIRROR" >&2
    # the same suites as the ubuntu:22.04 image
    as_root tee "$root/etc/apt/sources.list" >/dev/null <<SOURCES
deb $UBUNTU_MIRROR jammy main universe
deb $UBUNTU_MIRROR jammy-updates main universe
deb $UBUNTU_SECURITY jammy-security main universe
SOURCES
  else
    as_root debootstrap --variant=minbase bookworm "$root" "$DEBIAN_MIRROR" >&2
  fi
  as_root rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*
  as_root tar -C "$root" -c . | "$DOCKER" import - "$name" >&2
  as_root rm -rf "$root"
  echo "$name"
}

ensure_engine
if [ "$engine_only" = 1 ]; then command -v "$DOCKER"; exit 0; fi
base=$(ensure_base)
secret=()
cert=${SSL_CERT_FILE:-${PIP_CERT:-}}
if [ -n "$cert" ] && [ -f "$cert" ]; then
  secret=(--secret "id=cacert,src=$cert")
  log "passing $cert as the cacert build secret"
fi
log "building $tag (variant $variant, $python, base $base)"
start=$(date +%s)
DOCKER_BUILDKIT=1 "$DOCKER" build -f docker/Dockerfile \
  --build-arg BASE_IMAGE="$base" --build-arg PYTHON="$python" --build-arg VARIANT="$variant" \
  "${secret[@]}" -t "$tag" . >&2
log "built $tag in $(($(date +%s) - start)) s"
echo "$tag"
