#!/usr/bin/env bash
# Where bench/peer's side-by-side replay spends its time, as shares of one process's samples:
# kv-index's ingest (apply and the table), kv-index's queries, and the peer's own code. Their
# ratios compare two builds of kv-index without trusting either run's absolute speed (single
# runs on a shared VM vary by +-30 %): the peer's code and the queries are the yardstick.
#
#   scripts/profile_shares.sh PEER_BINARY [WORKERS] [SPLIT]      (default 1000 32)
#
# PEER_BINARY: bench/peer/target/release/peer of one build (copy it aside to compare builds).
# Needs perf.
set -euo pipefail
bin=$1
data=$(mktemp)
trap 'rm -f "$data"' EXIT
perf record -q -F 2000 -o "$data" taskset -c 1 "$bin" "${2:-1000}" "${3:-32}" off >/dev/null 2>&1
perf report -i "$data" --no-children --sort symbol 2>/dev/null | python3 -c '
import re, sys
ingest = query = peer = 0.0
for line in sys.stdin:
    m = re.match(r"\s+([\d.]+)%\s+\[\.\]\s+(\S+)", line)
    if not m:
        continue
    share, name = float(m.group(1)), m.group(2)
    if name.startswith("kv_index::"):
        if any(k in name for k in ("apply", "grow", "rebuild", "append_block", "Tokens::push",
                                   "set_tokens", "update_range")):
            ingest += share
        elif any(k in name for k in ("prefix", "settle", "Candidates")):
            query += share
    elif "dynamo" in name or "kv_router" in name:
        peer += share
print(f"kv-index ingest {ingest:.2f} %, kv-index queries {query:.2f} %, peer {peer:.2f} %; "
      f"ingest/peer {ingest / peer:.3f}, ingest/queries {ingest / query:.3f}")
'
