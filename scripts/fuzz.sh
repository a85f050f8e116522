#!/usr/bin/env bash
# Runs each cargo-fuzz target for a given time and prints executions and findings per target.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET=60] [TARGET...]   (targets: decode_batch zmq_frames grpc_index)
#
# Installs cargo-fuzz when missing. The machine's toolchain is stable, so RUSTC_BOOTSTRAP=1
# lets cargo-fuzz pass its nightly flags. Seeds come from the captured SGLang fixtures
# (scripts/fuzz_seeds.py); the corpus grows in fuzz/corpus/<target>, crashes land in
# fuzz/artifacts/<target> (reproduce with `cargo fuzz run <target> <file>`), logs in fuzz/logs.
# FUZZ_SANITIZER=address turns AddressSanitizer on (default none: the project denies unsafe
# code, and without it a target runs several times faster).
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(decode_batch zmq_frames grpc_index)

command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked || exit 1
export RUSTC_BOOTSTRAP=1
python3 scripts/fuzz_seeds.py fuzz/corpus >/dev/null || exit 1
sanitizer=${FUZZ_SANITIZER:-none}
(cd fuzz && cargo fuzz build -O -s "$sanitizer") || exit 1
mkdir -p fuzz/logs

declare -A max_len=([decode_batch]=65536 [zmq_frames]=65536 [grpc_index]=4096)
rows=()
status=0
for target in "${targets[@]}"; do
  log=fuzz/logs/$target.log
  (cd fuzz && cargo fuzz run -O -s "$sanitizer" "$target" "corpus/$target" -- \
      -max_total_time="$seconds" -max_len="${max_len[$target]:-65536}" \
      -print_final_stats=1 -close_fd_mask=3) >"$log" 2>&1
  code=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  rss=$(grep -o 'stat::peak_rss_mb: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*')
  crashes=$(find "fuzz/artifacts/$target" -type f 2>/dev/null | wc -l)
  if [ "$code" -ne 0 ]; then
    status=1
    finding="FAILED (exit $code, see $log)"
  else
    finding="no crash"
  fi
  rows+=("$(printf '%-13s %8ss %14s %10s %8s %9s  %s' "$target" "$seconds" "${execs:-?}" "$(( ${execs:-0} / seconds ))" "${cov:-?}" "${rss:-?}" "$finding; artifacts: $crashes")")
done

printf '%-13s %9s %14s %10s %8s %9s  %s\n' target time executions execs/s edges rss_mb findings
printf '%s\n' "${rows[@]}"
exit $status
