#!/bin/sh
# Installs promtool (from Debian's `prometheus` package) when it is missing: .ci/run checks and
# tests the alert rules with it (scripts/check_ops.py). Only the promtool binary is taken from
# the package (`apt-get download` + `dpkg-deb -x`), so no Prometheus daemon is installed or
# started. Run by .ci/run; safe to run again.
set -eu
if command -v promtool >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
# apt-get download needs no root; a stale package list (a version gone from the mirror) is
# refreshed once.
if ! apt-get download -qq prometheus >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    apt-get download -qq prometheus >/dev/null
fi
dpkg-deb -x prometheus_*.deb root
$SUDO install -m 0755 root/usr/bin/promtool /usr/local/bin/promtool
promtool --version 2>&1 | head -n 1
