#!/usr/bin/env bash
# Installs Debian's chromium for the viewer's browser tests (tests/viewer/test_viewer.py); safe to rerun.
# The tests drive it through playwright with executable_path=/usr/bin/chromium, so no
# `playwright install` (which would download a second browser) is ever needed.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  echo "chromium present: $(/usr/bin/chromium --version 2>/dev/null || echo unknown version)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "chromium is absent; run this script as root to install it" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# fonts-liberation: readable glyphs in screenshots; chromium pulls its own libraries.
apt-get install -y -q --no-install-recommends chromium fonts-liberation
/usr/bin/chromium --version
