#!/usr/bin/env bash
# Start podman's Docker-API service so relax_gym's sandbox can run code in containers.
#
# Idempotent; run as root. Installs podman + runc if absent, writes the
# containers.conf that works on these machines (runc, explicit nofile+nproc
# ulimits: crun and higher limits fail here, and a missing nproc default makes
# container start fail with "error setting rlimit type 6"), starts
# `podman system service` on a unix socket when nothing answers there, and
# waits until it answers /_ping. Prints the DOCKER_HOST to export.
set -euo pipefail

SOCK="${PODMAN_SOCK:-/run/podman/podman.sock}"
LOG="${PODMAN_LOG:-/tmp/podman-service.log}"
CONF=/etc/containers/containers.conf

if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc curl >/dev/null
fi
command -v curl >/dev/null || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null
}

mkdir -p /etc/containers
DESIRED_CONF='[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"'
if [[ ! -f "$CONF" ]] || [[ "$(cat "$CONF")" != "$DESIRED_CONF" ]]; then
    printf '%s\n' "$DESIRED_CONF" > "$CONF"
fi

ping_ok() {
    [[ "$(curl -s --max-time 3 --unix-socket "$SOCK" http://d/_ping 2>/dev/null)" == "OK" ]]
}

if ! ping_ok; then
    mkdir -p "$(dirname "$SOCK")"
    rm -f "$SOCK"
    # setsid + nohup: the service must outlive this script and its session. It runs in a folder of
    # its own: conmon writes an `oom` marker into its working directory when a container is
    # OOM-killed, which would otherwise land in whatever checkout started the service.
    mkdir -p /run/relax-gym-podman
    cd /run/relax-gym-podman
    setsid nohup podman system service --time=0 "unix://$SOCK" >>"$LOG" 2>&1 < /dev/null &
    for _ in $(seq 1 60); do
        ping_ok && break
        sleep 0.5
    done
    ping_ok || { echo "podman service did not answer on $SOCK; see $LOG" >&2; exit 1; }
fi

echo "DOCKER_HOST=unix://$SOCK"
