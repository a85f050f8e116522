#!/bin/sh
# Installs h2load (Debian's nghttp2-client) when it is missing: scripts/grpc_cores.py --h2load
# sends pre-encoded gRPC requests with it, a generator that costs the server's cores little.
# Safe to run again.
set -eu
"$(dirname "$0")/apt_install.sh" h2load nghttp2-client
h2load --version
