#!/usr/bin/env bash
# Installs the wheel in dist/ into a new venv and checks what a user gets: the four binaries on
# the venv's PATH, each answering --version with the version and the commit, and a server
# started from the venv answering `kv-indexer-ctl health` SERVING. Run by .ci/run after
# scripts/build_wheel.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

wheels=(dist/sgl_kv_indexer-*.whl)
[[ -f ${wheels[0]} ]] || { echo "no wheel in dist/: run scripts/build_wheel.sh" >&2; exit 1; }
VENV=$(mktemp -d)
trap 'kill "${server:-}" 2>/dev/null || true; rm -rf "$VENV"' EXIT
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --no-index "${wheels[0]}"
export PATH="$VENV/bin:$PATH"

for bin in kv-indexer-server kv-indexer-bridge kv-indexer-ctl kv-indexer-router; do
  [[ $(command -v "$bin") == "$VENV/bin/$bin" ]] || { echo "$bin is not on the venv's PATH" >&2; exit 1; }
  version=$("$bin" --version)
  [[ $version =~ ^$bin\ [0-9]+\.[0-9]+\.[0-9]+\ \(commit\ [0-9a-f]{7,}\)$ ]] ||
    { echo "$bin --version: '$version' lacks the version or the commit" >&2; exit 1; }
  echo "$version"
done

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
kv-indexer-server --listen-addr "127.0.0.1:$port" >"$VENV/server.log" 2>&1 &
server=$!
for _ in $(seq 1 100); do
  if kv-indexer-ctl --endpoint "http://127.0.0.1:$port" --timeout-ms 500 health >/dev/null 2>&1; then
    echo "the wheel's kv-indexer-server answers kv-indexer-ctl health: SERVING"
    exit 0
  fi
  kill -0 "$server" 2>/dev/null || { cat "$VENV/server.log" >&2; exit 1; }
  sleep 0.1
done
echo "the wheel's server did not answer health SERVING within 10 s" >&2
cat "$VENV/server.log" >&2
exit 1
