#!/usr/bin/env bash
# Checks the wheel in dist/ as a user gets it: no binary needs a glibc symbol newer than the
# wheel's platform tag says (manylinux_2_17: GLIBC_2.17, as auditwheel checks), then, installed
# into a new venv, the five binaries on the venv's PATH, each answering --version with the
# version and the commit, and a server started from the venv answering `kv-indexer-ctl health`
# SERVING. Run by .ci/run after scripts/build_wheel.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

wheels=(dist/sgl_kv_indexer-*.whl)
[[ -f ${wheels[0]} ]] || { echo "no wheel in dist/: run scripts/build_wheel.sh" >&2; exit 1; }
# The newest glibc symbol version each binary needs, against the tag's (objdump, from binutils).
python3 - "${wheels[0]}" <<'PY'
import re, subprocess, sys, tempfile, zipfile
wheel = sys.argv[1]
tags = re.findall(r"manylinux_(\d+)_(\d+)_x86_64", wheel)
if not tags:
    sys.exit(f"{wheel}: no manylinux_X_Y platform tag")
allowed = min((int(a), int(b)) for a, b in tags)
with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as archive:
    binaries = [n for n in archive.namelist() if ".data/scripts/" in n and not n.endswith("/")]
    if len(binaries) != 5:
        sys.exit(f"{wheel}: {len(binaries)} binaries, expected 5: {binaries}")
    for name in binaries:
        path = archive.extract(name, tmp)
        symbols = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
        needed = {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_(\d+\.\d+)", symbols)}
        newest = max(needed, default=(0, 0))
        too_new = sorted(v for v in needed if v > allowed)
        if too_new:
            offending = sorted({line.split()[-1] for line in symbols.splitlines()
                                if any(f"GLIBC_{a}.{b}" in line for a, b in too_new)})
            sys.exit(f"{name} needs GLIBC_{newest[0]}.{newest[1]}, newer than the tag's {allowed[0]}.{allowed[1]}: {offending}")
        print(f"{name.rsplit('/', 1)[1]}: newest glibc symbol GLIBC_{newest[0]}.{newest[1]} (tag allows {allowed[0]}.{allowed[1]})")
PY

VENV=$(mktemp -d)
trap 'kill "${server:-}" 2>/dev/null || true; rm -rf "$VENV"' EXIT
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --no-index "${wheels[0]}"
export PATH="$VENV/bin:$PATH"

for bin in kv-indexer-server kv-indexer-bridge kv-indexer-ctl kv-indexer-router kv-indexer-sim; do
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
