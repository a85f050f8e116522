#!/usr/bin/env python3
"""Query latency at the server while applies flow (issue 36, item 5): for each server build
(--server NAME=PATH, repeatable; default this checkout's target/release), interleaved over
--runs rounds:

1. capacity: applies alone as fast as they go (kv-indexer-loadgen --ingest-ops far above it,
   one query a second), the block-ops/s the writer achieved;
2. queries at a fixed rate (--qps, --concurrency in flight, prompts of --prompt-blocks blocks)
   with REPORT/REVOKE churn at 0, 30 % and 100 % of that build's capacity: answered latency
   p50/p99/max and the churn achieved.

Each measurement starts a fresh in-memory server (pinned to --server-cpus), the generator on
--loadgen-cpus. Prints one line per run and the medians. Only the Python standard library.

    scripts/reads_under_ingest.py --server old=/tmp/old/kv-indexer-server --server new=target/release/kv-indexer-server
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HOST, tcp_open, wait_until  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def loadgen(args, port, ingest_ops, qps, out):
    argv = ["taskset", "-c", args.loadgen_cpus, args.loadgen, "--endpoint", f"http://{HOST}:{port}",
            "--prompt-blocks", str(args.prompt_blocks), "--qps", str(qps),
            "--concurrency", str(args.concurrency), "--duration-secs", str(args.duration_s),
            "--ingest-ops", str(int(ingest_ops)), "--json-out", out]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return json.loads(f.readlines()[-1])


def measure(args, binary, ingest_ops, qps, logs):
    port = free_port()
    log = open(os.path.join(logs, f"server-{port}.log"), "w")
    server = subprocess.Popen(["taskset", "-c", args.server_cpus, binary, "--listen-addr",
                               f"{HOST}:{port}", "--worker-ttl-s", "0"], stdout=log, stderr=log)
    try:
        wait_until(lambda: tcp_open(port), "the server")
        return loadgen(args, port, ingest_ops, qps, os.path.join(logs, "loadgen.jsonl"))
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def field(report, *names):
    for name in names:
        if name in report:
            return report[name]
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", default=[], help="NAME=PATH of a kv-indexer-server")
    ap.add_argument("--loadgen", default=os.path.join(ROOT, "target/release/kv-indexer-loadgen"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--qps", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-blocks", type=int, default=1024)
    ap.add_argument("--duration-s", type=int, default=8)
    ap.add_argument("--server-cpus", default="0")
    ap.add_argument("--loadgen-cpus", default="1")
    args = ap.parse_args()
    servers = [s.split("=", 1) for s in args.server] or [
        ["this", os.path.join(ROOT, "target/release/kv-indexer-server")]]
    logs = tempfile.mkdtemp(prefix="kv-reads-under-ingest-")
    results = {}
    for run in range(args.runs):
        order = servers if run % 2 == 0 else list(reversed(servers))
        for name, binary in order:
            capacity = field(measure(args, binary, 100e6, 1, logs), "apply_block_ops_per_s") or 0
            for share in (0.0, 0.3, 1.0):
                report = measure(args, binary, share * capacity, args.qps, logs)
                key = (name, share)
                results.setdefault(key, []).append(report)
                print(f"{name:<8} run {run} ingest {share:>4.0%} of {capacity / 1e6:5.2f} M/s: "
                      f"query p50 {report.get('answered_p50_us')} p99 {report.get('answered_p99_us')} "
                      f"max {report.get('answered_max_us')} µs, answered {report.get('answered')}, "
                      f"churn {field(report, 'apply_block_ops_per_s')}",
                      flush=True)
    print("\nmedians (µs):")
    for (name, share), reports in sorted(results.items()):
        def median(key):
            values = sorted(r.get(key) or 0 for r in reports)
            return values[len(values) // 2]
        print(f"{name:<8} ingest {share:>4.0%}: query p50 {median('answered_p50_us')} "
              f"p99 {median('answered_p99_us')} max {median('answered_max_us')}")
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
