#!/usr/bin/env bash
# Makes a local `debian:bookworm-slim` when the machine has no image registry to pull it from:
# debootstrap (minbase) from the Debian mirror apt already uses, the same apt sources as Debian's own
# image (bookworm, -updates, -security), plus the host's extra CA certificates so that apt, pip and cargo
# inside `docker build` trust the same TLS chain as the host. Does nothing when the image exists.
# Usage: deploy/base-image.sh WORKDIR   (root, docker and debootstrap; about 2 minutes)
set -euo pipefail
work=${1:?usage: deploy/base-image.sh WORKDIR}
image=debian:bookworm-slim
docker image inspect "$image" >/dev/null 2>&1 && exit 0

mirror=$(grep -rhoE 'https?://[^ ]+/debian/?$|https?://[^ ]+/debian/? ' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
  head -n 1 | tr -d ' ' || true)
mirror=${mirror:-http://deb.debian.org/debian}
mirror=${mirror%/}
rootfs=$work/rootfs
# A half-finished debootstrap from an interrupted run is started over.
[ -f "$rootfs/.complete" ] || {
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs" "$mirror"
  touch "$rootfs/.complete"
}
rm -f "$rootfs/etc/apt/sources.list"
cat > "$rootfs/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${mirror}-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
chroot "$rootfs" update-ca-certificates >/dev/null
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" --exclude=./.complete -c . | docker import --change 'CMD ["bash"]' - "$image" >/dev/null
echo "base-image: built $image from $mirror" >&2
