#!/bin/sh
# Installs h2load (Debian's nghttp2-client) when it is missing: scripts/grpc_cores.py --h2load
# sends pre-encoded gRPC requests with it, a generator that costs the server's cores little.
# Safe to run again.
set -eu
if command -v h2load >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends nghttp2-client >/dev/null
h2load --version
