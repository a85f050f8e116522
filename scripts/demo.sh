#!/usr/bin/env bash
# One-command local demo: the Indexer, three simulated SGLang workers with their bridges, and
# the router, all on loopback. Sends prompts that share prefixes, prints each routing decision
# with the matched blocks and the worker's cached_tokens, then stops everything it started.
#
#   scripts/demo.sh            (ports: 50061 indexer, 31000-31002 workers, 5600-5602 events, 30080 router)
#   scripts/demo.sh --replicas 2
#       a fleet: redis-server (installed by scripts/install_redis.sh when missing) on 6390, the
#       Indexer replicas on 50061, 50062, … sharing its stream; bridges and the router list every
#       replica; at the end the first replica is killed and the router keeps its cache signal.
set -euo pipefail
cd "$(dirname "$0")/.."

REPLICAS=1
if [[ "${1:-}" == "--replicas" ]]; then
  REPLICAS=${2:?--replicas needs a number}
  [[ "$REPLICAS" =~ ^[1-9][0-9]*$ ]] || { echo "--replicas must be a positive number, not $REPLICAS" >&2; exit 2; }
elif [[ -n "${1:-}" ]]; then
  echo "usage: scripts/demo.sh [--replicas N]" >&2
  exit 2
fi

BASE_PORT=${DEMO_BASE_PORT:-31000}
EVENTS_PORT=${DEMO_EVENTS_PORT:-5600}
INDEXER_PORT=${DEMO_INDEXER_PORT:-50061}
REDIS_PORT=${DEMO_REDIS_PORT:-6390}
ROUTER=127.0.0.1:${DEMO_ROUTER_PORT:-30080}
LOGS=$(mktemp -d)

echo "building (release)…"
cargo build --release -q -p sgl-kv-indexer -p kv-indexer-sim -p kv-indexer-router
BIN=target/release

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "stopped everything; logs in $LOGS"
}
trap cleanup EXIT

fleet=()
endpoints=()
if ((REPLICAS > 1)); then
  scripts/install_redis.sh
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no --dir "$LOGS" \
    >"$LOGS/redis.log" 2>&1 &
  pids+=($!)
  fleet=(--event-log "redis://127.0.0.1:$REDIS_PORT/0" --snapshot-interval-s 5)
fi
for k in $(seq 0 $((REPLICAS - 1))); do
  "$BIN/kv-indexer-server" --listen-addr "127.0.0.1:$((INDEXER_PORT + k))" "${fleet[@]}" \
    >"$LOGS/server-$k.log" 2>&1 &
  pids+=($!)
  endpoints+=("http://127.0.0.1:$((INDEXER_PORT + k))")
done
server_pid=${pids[-REPLICAS]}
ENDPOINTS=$(IFS=,; echo "${endpoints[*]}")
urls=()
for i in 0 1 2; do
  port=$((BASE_PORT + i)); events=$((EVENTS_PORT + i))
  "$BIN/kv-indexer-sim" --port "$port" --kv-events-port "$events" --capacity-tokens 32768 \
    --prefill-us-per-token 20 --decode-us-per-token 200 >"$LOGS/sim-$i.log" 2>&1 &
  pids+=($!)
  KV_INDEXER_WORKER_ID="sim-$i" KV_INDEXER_WORKER_ADDRESS="http://127.0.0.1:$port" \
    SGLANG_KV_EVENT_ENDPOINT="tcp://127.0.0.1:$events" SGLANG_KV_EVENT_TOPIC=kv-events \
    KV_INDEXER_ENDPOINT="$ENDPOINTS" "$BIN/kv-indexer-bridge" >"$LOGS/bridge-$i.log" 2>&1 &
  pids+=($!)
  urls+=("http://127.0.0.1:$port")
done
"$BIN/kv-indexer-router" --listen-addr "$ROUTER" --worker-urls "$(IFS=,; echo "${urls[*]}")" \
  --kv-indexer-endpoint "$ENDPOINTS" --cache-affinity-min-matched-tokens 32 >"$LOGS/router.log" 2>&1 &
pids+=($!)

wait_http() {
  for _ in $(seq 1 200); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "timed out waiting for $1" >&2
  return 1
}
for url in "${urls[@]}"; do wait_http "$url/health"; done
wait_http "http://$ROUTER/health"
sleep 1 # the router learns the block size from the first worker's /server_info

ask() {
  local label=$1 text=$2
  local headers body
  headers=$(mktemp)
  body=$(curl -s -D "$headers" "http://$ROUTER/generate" -H 'content-type: application/json' \
    -d "{\"text\": \"$text\", \"sampling_params\": {\"max_new_tokens\": 8}}")
  python3 - "$label" "$headers" "$body" <<'PY'
import json, sys
label, headers, body = sys.argv[1], sys.argv[2], sys.argv[3]
h = {}
for line in open(headers):
    if ":" in line:
        k, v = line.split(":", 1)
        h[k.strip().lower()] = v.strip()
meta = json.loads(body).get("meta_info", {})
print(f"{label:<28} -> {h.get('x-routed-worker','?'):<24} reason={h.get('x-routing-reason','?'):<16} "
      f"matched={h.get('x-matched-blocks','?')}/{h.get('x-query-blocks','?')} blocks  "
      f"prompt_tokens={meta.get('prompt_tokens')} cached_tokens={meta.get('cached_tokens')}")
PY
  rm -f "$headers"
}

doc() { # a long deterministic document: $1 = topic word, $2 = words
  python3 -c "import sys; print(' '.join(f'{sys.argv[1]}{i}' for i in range(int(sys.argv[2]))))" "$1" "$2"
}
A=$(doc alpha 400); B=$(doc beta 400); C=$(doc gamma 400)

echo
echo "routing decisions (router → worker, the Indexer's matched blocks, the worker's cached tokens):"
ask "doc A, question 1" "$A question one"
ask "doc B, question 1" "$B question one"
ask "doc C, question 1" "$C question one"
sleep 0.3 # events reach the index within milliseconds; leave room on a busy machine
ask "doc A, question 2" "$A question two"
ask "doc B, question 2" "$B question two"
ask "doc A, question 3" "$A question three"
ask "doc C, question 2" "$C question two"
ask "unrelated prompt" "$(doc delta 50)"
if ((REPLICAS > 1)); then
  echo
  echo "killing the first replica (kill -9): the router and the bridges go on with the next one"
  { kill -9 "$server_pid" && wait "$server_pid"; } 2>/dev/null || true
  ask "doc B, question 3" "$B question three"
  ask "doc C, question 3" "$C question three"
fi
