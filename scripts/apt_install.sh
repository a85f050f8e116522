#!/bin/sh
# apt_install.sh COMMAND PACKAGE: installs Debian's PACKAGE (no recommends) when COMMAND is
# missing; what install_redis.sh and install_h2load.sh share. Safe to run again.
set -eu
if command -v "$1" >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "$2" >/dev/null
