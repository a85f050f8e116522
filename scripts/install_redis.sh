#!/bin/sh
# Installs redis-server (Debian's package) when it is missing: the fleet tests start a real one.
# Run by .ci/run; safe to run again.
set -eu
if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
"$(dirname "$0")/apt_install.sh" redis-server redis-server
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
# The package starts a system-wide server on port 6379; the tests start their own.
$SUDO systemctl disable --now redis-server >/dev/null 2>&1 || $SUDO service redis-server stop >/dev/null 2>&1 || true
redis-server --version
