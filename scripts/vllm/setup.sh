#!/usr/bin/env bash
# The vLLM 0.33.0 wheel (only downloaded: neither installed nor imported whole; 336 MB) and a
# venv with the real third-party packages its event and hashing modules import, both cached
# under ${KV_INDEXER_VLLM_CACHE:-~/.cache/kv-indexer-vllm}. Prints the wheel's path; the venv's
# python is "$(dirname <wheel>)/venv/bin/python". Used by .ci/run for scripts/vllm/live_e2e.py.
set -euo pipefail
CACHE=${KV_INDEXER_VLLM_CACHE:-$HOME/.cache/kv-indexer-vllm}
WHEEL=$CACHE/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
mkdir -p "$CACHE"
if [[ ! -f $WHEEL ]]; then
  python3 -m pip download --quiet --no-deps vllm==0.33.0 -d "$CACHE" >&2
fi
if [[ ! -x $CACHE/venv/bin/python ]]; then
  python3 -m venv "$CACHE/venv"
  "$CACHE/venv/bin/pip" install --quiet msgspec==0.23.0 cbor2==6.3.0 pyzmq==27.3.0 xxhash==4.1.0 >&2
fi
echo "$WHEEL"
