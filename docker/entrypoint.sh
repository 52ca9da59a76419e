#!/usr/bin/env bash
# Entrypoint of the MultiMesh image: runs the command as the non-root user mm (uid 1000), or,
# when the working directory is a bind mount that mm cannot write, as the mount's owner, so
# notebooks in it can be saved. A root-owned mount (a host directory of root's, or any of
# yours under rootless Docker) therefore runs as root; choose otherwise with `docker run --user`.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then           # started with --user: keep it
  [ -w . ] || echo "multimesh: $(pwd) is not writable by uid $(id -u)" >&2
  exec "$@"
fi

run_as_mm() { exec setpriv --reuid=1000 --regid=1000 --init-groups env HOME=/home/mm USER=mm "$@"; }

if setpriv --reuid=1000 --regid=1000 --init-groups test -w . || ! mountpoint -q .; then
  run_as_mm "$@"
fi
uid=$(stat -c %u .)
gid=$(stat -c %g .)
if [ "$uid" = 0 ]; then
  echo "multimesh: $(pwd) is a root-owned mount: running as root so it stays writable" \
    "(docker run --user UID:GID to choose)" >&2
  exec "$@"
fi
home=/tmp/home-$uid
mkdir -p "$home" && chown "$uid:$gid" "$home"
exec setpriv --reuid="$uid" --regid="$gid" --clear-groups env HOME="$home" "$@"
