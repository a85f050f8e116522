#!/usr/bin/env bash
# One-command local demo: the Indexer, three simulated SGLang workers with their bridges, and
# the router, all on loopback. Sends prompts that share prefixes, prints each routing decision
# with the matched blocks and the worker's cached_tokens, then stops everything it started.
# It fails (non-zero, naming the component and showing its log) when a component exits at start
# (a port taken) or a request is not answered.
#
#   scripts/demo.sh            (ports: 50061 indexer, 31000-31002 workers, 5600-5602 events, 30080 router)
#   scripts/demo.sh --replicas 2
#       a fleet: redis-server (installed by scripts/install_redis.sh when missing) on 6390, the
#       Indexer replicas on 50061, 50062, … sharing its stream; bridges and the router list every
#       replica; at the end the first replica is killed and the router keeps its cache signal.
#   scripts/demo.sh --engine vllm
#       the workers are simulated vLLM workers (vLLM's events, block hashes and OpenAI API); the
#       bridges and the router are told so, and the prompts go to /v1/completions.
#   scripts/demo.sh --keep
#       leaves everything running until Ctrl-C, and prints what to try meanwhile (the
#       router, kv-indexer-ctl, the router's /metrics).
# At the end it prints what the Indexer holds (`kv-indexer-ctl workers`).
set -euo pipefail
cd "$(dirname "$0")/.."

REPLICAS=1
ENGINE=sglang
KEEP=0
usage() { echo "usage: scripts/demo.sh [--replicas N] [--engine sglang|vllm] [--keep]" >&2; exit 2; }
while (($#)); do
  case $1 in
    --replicas)
      REPLICAS=${2:?--replicas needs a number}; shift 2
      [[ "$REPLICAS" =~ ^[1-9][0-9]*$ ]] || { echo "--replicas must be a positive number, not $REPLICAS" >&2; exit 2; } ;;
    --engine)
      ENGINE=${2:?--engine needs sglang or vllm}; shift 2
      [[ $ENGINE == sglang || $ENGINE == vllm ]] || { echo "--engine must be sglang or vllm, not $ENGINE" >&2; exit 2; } ;;
    --keep) KEEP=1; shift ;;
    *) usage ;;
  esac
done
# The router learns the block hashing from the workers (SGLang's /server_info, vLLM's /metrics).
ENGINE_FLAGS=(--engine "$ENGINE")

BASE_PORT=${DEMO_BASE_PORT:-31000}
EVENTS_PORT=${DEMO_EVENTS_PORT:-5600}
INDEXER_PORT=${DEMO_INDEXER_PORT:-50061}
REDIS_PORT=${DEMO_REDIS_PORT:-6390}
ROUTER=127.0.0.1:${DEMO_ROUTER_PORT:-30080}
LOGS=$(mktemp -d)

# DEMO_BIN=target/debug: use binaries already built (CI's test build) instead of a release build.
# DEMO_METRICS_DIR=dir: every component serves /metrics, scraped into dir/<name>.prom at the end
# (scripts/check_ops.py --metrics checks them against the dashboard and the alert rules).
METRICS_DIR=${DEMO_METRICS_DIR:-}
METRICS_PORT=${DEMO_METRICS_PORT:-9460}
# cargo writes to CARGO_TARGET_DIR when it is set (relative to the checkout, as cargo reads it
# here), else to target.
if [[ -n "${DEMO_BIN:-}" ]]; then
  BIN=$DEMO_BIN
else
  echo "building (release)…"
  cargo build --release -q -p sgl-kv-indexer
  BIN=${CARGO_TARGET_DIR:-target}/release
fi
for bin in kv-indexer-server kv-indexer-bridge kv-indexer-ctl kv-indexer-router kv-indexer-sim; do
  [[ -x $BIN/$bin ]] ||
    { echo "missing $BIN/$bin (DEMO_BIN or CARGO_TARGET_DIR names where cargo built it)" >&2; exit 1; }
done

pids=()
names=()
cleanup() { # the last started first, each gone before the next: no WARN about what it used
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[$i]}" 2>/dev/null || true
    wait "${pids[$i]}" 2>/dev/null || true
  done
  echo "stopped everything; logs in $LOGS"
}
trap cleanup EXIT

start() { # start NAME COMMAND...: runs COMMAND in the background, its output in $LOGS/NAME.log
  local name=$1
  shift
  "$@" >"$LOGS/$name.log" 2>&1 &
  pids+=($!)
  names+=("$name")
}

alive() { # fails naming the first component that has exited (a port taken, a bad setting)
  local i
  for i in "${!pids[@]}"; do
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      echo "${names[$i]} exited at start (is its port taken?); from $LOGS/${names[$i]}.log:" >&2
      grep -m1 -A3 -i '^error' "$LOGS/${names[$i]}.log" >&2 || tail -n 5 "$LOGS/${names[$i]}.log" >&2
      exit 1
    fi
  done
}

until_ready() { # until_ready WHAT COMMAND...: until COMMAND succeeds, while everything runs
  local what=$1
  shift
  for _ in $(seq 1 400); do
    alive
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "timed out waiting for $what" >&2
  exit 1
}

scraped=() # NAME=ADDR of each component serving /metrics
admin_for() { # admin_for NAME: ADMIN=the next admin address, noted for the scrape at the end
  ADMIN="127.0.0.1:$((METRICS_PORT + ${#scraped[@]}))"
  scraped+=("$1=$ADMIN")
}

fleet=()
endpoints=()
if ((REPLICAS > 1)); then
  scripts/install_redis.sh
  start redis redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no \
    --dir "$LOGS"
  until_ready "Redis on $REDIS_PORT" redis-cli -p "$REDIS_PORT" ping
  fleet=(--event-log "redis://127.0.0.1:$REDIS_PORT/0" --snapshot-interval-s 5)
fi
for k in $(seq 0 $((REPLICAS - 1))); do
  admin=()
  if [[ -n $METRICS_DIR ]]; then admin_for "server-$k"; admin=(--metrics-addr "$ADMIN"); fi
  start "server-$k" "$BIN/kv-indexer-server" --listen-addr "127.0.0.1:$((INDEXER_PORT + k))" \
    "${fleet[@]}" "${admin[@]}"
  endpoints+=("http://127.0.0.1:$((INDEXER_PORT + k))")
done
server_pid=${pids[-REPLICAS]}
ENDPOINTS=$(IFS=,; echo "${endpoints[*]}")
# Started in order, each once what it uses answers, so that none starts with a WARN about the
# one before: Redis, the replicas (recovered from it), the workers, their bridges, the router.
until_ready "the Indexer to serve" "$BIN/kv-indexer-ctl" health --endpoint "$ENDPOINTS" --timeout-ms 500
# Each worker's URL is the router's --worker-urls entry, its bridge's KV_INDEXER_WORKER_ADDRESS
# and the `worker` label of both's metrics: one string, byte for byte.
urls=()
for i in 0 1 2; do
  port=$((BASE_PORT + i)); events=$((EVENTS_PORT + i))
  start "sim-$i" "$BIN/kv-indexer-sim" "${ENGINE_FLAGS[@]}" --port "$port" --kv-events-port "$events" \
    --capacity-tokens 32768 --prefill-us-per-token 20 --decode-us-per-token 200
  urls+=("http://127.0.0.1:$port")
done
for url in "${urls[@]}"; do until_ready "$url/health" curl -sf "$url/health"; done
for i in 0 1 2; do
  admin=()
  if [[ -n $METRICS_DIR ]]; then admin_for "bridge-$i"; admin=(KV_INDEXER_BRIDGE_METRICS_ADDR="$ADMIN"); fi
  start "bridge-$i" env "${admin[@]}" KV_INDEXER_WORKER_ID="sim-$i" KV_INDEXER_WORKER_ADDRESS="${urls[$i]}" \
    SGLANG_KV_EVENT_ENDPOINT="tcp://127.0.0.1:$((EVENTS_PORT + i))" SGLANG_KV_EVENT_TOPIC=kv-events \
    KV_INDEXER_ENDPOINT="$ENDPOINTS" KV_INDEXER_ENGINE="$ENGINE" "$BIN/kv-indexer-bridge"
done
start router "$BIN/kv-indexer-router" "${ENGINE_FLAGS[@]}" --listen-addr "$ROUTER" \
  --worker-urls "$(IFS=,; echo "${urls[*]}")" --kv-indexer-endpoint "$ENDPOINTS" \
  --cache-affinity-min-matched-tokens 32

router_knows_block_size() { curl -sf "http://$ROUTER/health" | grep -Eq '"block_size":[0-9]+'; }
# The router's /health answers 200 once a worker passes its health check; the demo also waits
# for the block size it learns from the first worker (cache-aware routing needs it).
until_ready "the router's /health and block size" router_knows_block_size

ask() {
  local label=$1 text=$2
  local headers body
  headers=$(mktemp)
  local route=/generate request="{\"text\": \"$text\", \"sampling_params\": {\"max_new_tokens\": 8}}"
  if [[ $ENGINE == vllm ]]; then
    route=/v1/completions request="{\"prompt\": \"$text\", \"max_tokens\": 8}"
  fi
  if ! body=$(curl -s -S --fail-with-body -D "$headers" "http://$ROUTER$route" \
    -H 'content-type: application/json' -d "$request" 2>&1); then
    echo "$label: the router did not answer it: $body (router log: $LOGS/router.log)" >&2
    exit 1
  fi
  python3 - "$label" "$headers" "$body" <<'PY'
import json, sys
label, headers, body = sys.argv[1], sys.argv[2], sys.argv[3]
h = {}
for line in open(headers):
    if ":" in line:
        k, v = line.split(":", 1)
        h[k.strip().lower()] = v.strip()
answer = json.loads(body)
meta = answer.get("meta_info")
if meta is None:  # vLLM's OpenAI answer
    usage = answer["usage"]
    meta = {"prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}
print(f"{label:<28} -> {h.get('x-routed-worker','?'):<24} reason={h.get('x-routing-reason','?'):<16} "
      f"matched={h.get('x-matched-blocks','?')}/{h.get('x-query-blocks','?')} blocks "
      f"{h.get('x-matched-tokens','?')} tokens  "
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
alive # a component that lost its port to another of its kind exits, if slowly: not before now
if ((REPLICAS > 1)); then
  echo
  echo "killing the first replica (kill -9): the router and the bridges go on with the next one"
  { kill -9 "$server_pid" && wait "$server_pid"; } 2>/dev/null || true
  ask "doc B, question 3" "$B question three"
  ask "doc C, question 3" "$C question three"
fi
echo
echo "what the Indexer holds (kv-indexer-ctl workers):"
"$BIN/kv-indexer-ctl" --endpoint "$ENDPOINTS" workers
if [[ -n $METRICS_DIR ]]; then
  mkdir -p "$METRICS_DIR"
  scraped+=("router=$ROUTER")
  for entry in "${scraped[@]}"; do
    name=${entry%%=*}
    [[ $name == server-0 && $REPLICAS -gt 1 ]] && continue # killed above
    curl -sf "http://${entry#*=}/metrics" >"$METRICS_DIR/$name.prom" ||
      { echo "scraping $name's /metrics at ${entry#*=} failed" >&2; exit 1; }
  done
  echo "metrics of ${#scraped[@]} components in $METRICS_DIR"
fi
if ((KEEP)); then
  example="/generate -d '{\"text\": \"$(doc alpha 40) question four\"}'"
  if [[ $ENGINE == vllm ]]; then
    example="/v1/completions -d '{\"prompt\": \"$(doc alpha 40) question four\", \"max_tokens\": 8}'"
  fi
  cat <<EOF

everything keeps running until Ctrl-C; meanwhile, from another terminal:
  curl -s http://$ROUTER$example -D - -o /dev/null
        (the x-routing-reason, x-routed-worker and x-matched-blocks headers)
  $BIN/kv-indexer-ctl --endpoint $ENDPOINTS workers     (and state, prefix --text "…")
  curl -s http://$ROUTER/metrics | grep kv_router_decisions_total
  logs: $LOGS
EOF
  while alive; do sleep 1; done
fi
