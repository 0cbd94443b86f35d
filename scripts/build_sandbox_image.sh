#!/usr/bin/env bash
# Build relax_gym's code-execution image offline: no container registry is
# reachable here, so the image is a Debian rootfs made by debootstrap from the
# machine's own Debian mirror and imported with `podman import`.
#
# Idempotent: does nothing when the image exists, unless FORCE=1. Run as root,
# after scripts/start_podman.sh. `python3-minimal` alone lacks json, asyncio,
# multiprocessing, ...: the image carries Debian's full python3.
set -euo pipefail

IMAGE="${IMAGE:-localhost/relax-gym-sandbox:latest}"
SUITE="${SUITE:-bookworm}"

if [[ "${FORCE:-0}" != "1" ]] && podman image exists "$IMAGE"; then
    echo "image $IMAGE exists (FORCE=1 rebuilds)"
    exit 0
fi
OLD_ID="$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"

if ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

# The first Debian mirror apt is configured with for $SUITE: deb822 files in
# sources.list.d first ("URIs:" + "Suites:" stanzas), then one-line entries.
find_mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f "$f" ]] || continue
        awk -v suite="$SUITE" '
            /^[[:space:]]*$/ { if (uri != "" && ok) { print uri; exit } uri = ""; ok = 0; next }
            /^URIs:/   { uri = $2 }
            /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == suite) ok = 1 }
            END { if (uri != "" && ok) print uri }' "$f" | head -n1
    done
    for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list; do
        [[ -f "$f" ]] || continue
        sed -E 's/\[[^]]*\]//' "$f" |
            awk -v suite="$SUITE" '$1 == "deb" && $3 == suite { print $2; exit }'
    done
}
MIRROR="${MIRROR:-$(find_mirror | head -n1)}"
[[ -n "$MIRROR" ]] || { echo "no Debian mirror for $SUITE in /etc/apt; set MIRROR=" >&2; exit 1; }

WORK="$(mktemp -d /var/tmp/relax-gym-rootfs.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
ROOTFS="$WORK/rootfs"

echo "debootstrap $SUITE from $MIRROR"
debootstrap --variant=minbase --include=python3 "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -n 30 "$WORK/debootstrap.log" >&2; exit 1; }

# Drop what code execution never needs (261 MB -> ~121 MB).
rm -rf "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/lib/apt/lists/* \
       "$ROOTFS"/usr/share/doc "$ROOTFS"/usr/share/man "$ROOTFS"/usr/share/info \
       "$ROOTFS"/usr/share/locale "$ROOTFS"/var/log/* "$ROOTFS"/tmp/*
# Mount point of the sandbox's writable tmpfs (the root itself runs read-only).
install -d -m 1777 "$ROOTFS/scratch"

tar -C "$ROOTFS" --numeric-owner -cf "$WORK/rootfs.tar" .
podman import --quiet \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PYTHONDONTWRITEBYTECODE=1' \
    --change 'WORKDIR /scratch' \
    --change 'CMD ["python3"]' \
    "$WORK/rootfs.tar" "$IMAGE" >/dev/null
# A rebuild leaves the previous image untagged; drop it unless a container still uses it.
if [[ -n "$OLD_ID" && "$OLD_ID" != "$(podman image inspect --format '{{.Id}}' "$IMAGE")" ]]; then
    podman rmi "$OLD_ID" >/dev/null 2>&1 || true
fi
echo "built $IMAGE ($(podman image inspect --format '{{.Size}}' "$IMAGE") bytes)"
