#!/usr/bin/env bash
# Builds the wheel into dist/: the four binaries of crates/sgl-kv-indexer (pyproject.toml),
# packaged by maturin (bindings = "bin"). maturin comes from PyPI into a build venv of its own
# (KV_INDEXER_BUILD_VENV, default ~/.cache/kv-indexer-build-venv); nothing is installed system-wide.
#
#   scripts/build_wheel.sh          manylinux2014 (glibc 2.17): linked with zig (`ziglang` from
#                                   PyPI), so it installs on any Linux x86_64 of the last decade
#   scripts/build_wheel.sh --host   linked by this machine's toolchain and tagged for its glibc
#                                   (manylinux_2_34 here): no second target, shares target/release
#   scripts/build_wheel.sh --host --dev
#                                   the same from the dev profile (target/debug): what CI builds
#                                   to check the packaging within its time budget
#
# Then: python3 -m venv v && v/bin/pip install dist/sgl_kv_indexer-*.whl && v/bin/kv-indexer-server --version
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=zig
PROFILE=(--release)
for arg in "$@"; do
  case "$arg" in
    --host) MODE=host ;;
    --dev) PROFILE=() ;;
    *) echo "usage: scripts/build_wheel.sh [--host] [--dev]" >&2; exit 2 ;;
  esac
done

VENV=${KV_INDEXER_BUILD_VENV:-$HOME/.cache/kv-indexer-build-venv}
[[ -x "$VENV/bin/pip" ]] || python3 -m venv "$VENV"
[[ -x "$VENV/bin/maturin" ]] || "$VENV/bin/pip" install -q "maturin>=1.9,<2.0"
if [[ $MODE == zig ]] && ! "$VENV/bin/python" -c 'import ziglang' 2>/dev/null; then
  "$VENV/bin/pip" install -q "ziglang>=0.13"
fi
export PATH="$VENV/bin:$PATH"

rm -f dist/sgl_kv_indexer-*.whl
if [[ $MODE == zig ]]; then
  # --zig links against glibc 2.17's symbols; the compatibility check then passes for 2014.
  maturin build "${PROFILE[@]}" --locked --out dist --zig --compatibility manylinux2014
else
  maturin build "${PROFILE[@]}" --locked --out dist
fi
ls -l dist/sgl_kv_indexer-*.whl
