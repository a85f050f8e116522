#!/usr/bin/env python3
"""What a second replica buys a router: prefix queries through the router's own client
(kv-indexer-client's IndexerClient, `kv-indexer-loadgen --router-client`) against one replica
and against two on one Redis stream, closed loop at a fixed concurrency.

Per arrangement and run: answers/s, latency p50/p99, and each replica's share of the queries it
answered (its kv_indexer_requests_total{rpc="MatchExternalKvPrefix"} before and after). Runs
alternate between the arrangements (--runs of each) and the medians are printed, with the
ratio two/one.

    scripts/replicas_bench.py [--runs 3] [--seconds 10] [--concurrency 32]
                              [--prompt-blocks 128] [--server-cpus 1] [--client-cpus 0]
                              [--bin-dir target/release]

--server-cpus pins the replicas, --client-cpus the load generator (taskset CPU lists), to see
which side limits the answer on a machine with few cores; the client's CPU use (cores, from
its rusage) is printed beside. Needs redis-server (scripts/install_redis.sh) and the release
binaries (built unless --no-build).
"""

import argparse
import json
import os
import resource
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

PREFIX_OK = re.compile(r'^kv_indexer_requests_total\{[^}]*rpc="MatchExternalKvPrefix"[^}]*code="Ok"[^}]*\} (\S+)$',
                       re.M)


def prefix_answers(admin):
    """The replica's answered prefix queries so far."""
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in PREFIX_OK.findall(text))


def pinned(argv, cpus):
    return ["taskset", "-c", cpus, *argv] if cpus else argv


def start_fleet(logs, ports, replicas, cpus, run):
    """Redis (flushed) and `replicas` replicas on its stream, once each serves."""
    redis = h.start_redis(logs, f"redis-{run}", ports("redis"))
    procs = [redis]
    for k in range(replicas):
        argv = [h.binary("kv-indexer-server"), "--listen-addr", ports.addr("server", k),
                "--metrics-addr", ports.addr("admin", k),
                "--event-log", f"redis://{h.HOST}:{ports('redis')}/0", "--snapshot-interval-s", "0"]
        procs.append(h.Proc(logs, f"server-{run}-{k}", pinned(argv, cpus)))
    for k in range(replicas):
        h.wait_state(ports.addr("admin", k), "fresh", f"replica {k} to serve")
    return procs


def measure(args, logs, ports, replicas, run):
    procs = start_fleet(logs, ports, replicas, args.server_cpus, run)
    try:
        admins = [ports.addr("admin", k) for k in range(replicas)]
        out = os.path.join(logs, f"loadgen-{run}.json")
        common = ["--workers", "64", "--prompts", "256", "--prompt-blocks", str(args.prompt_blocks),
                  "--seed", str(args.seed), "--timeout-ms", "100"]
        # The preload through replica 0 (the stream gives it to the others), then the queries.
        subprocess.run([h.binary("kv-indexer-loadgen"), "--endpoint", ports.url("server", 0), *common,
                        "--duration-secs", "0", "--concurrency", "1"],
                       check=True, capture_output=True)
        held = h.admin_state(admins[0])["placements"]
        for k in range(1, replicas):
            h.wait_until(lambda k=k: h.admin_state(admins[k])["placements"] == held,
                         f"replica {k} to hold the preload", timeout=60)
        before = [prefix_answers(a) for a in admins]
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        endpoints = ",".join(ports.url("server", k) for k in range(replicas))
        subprocess.run(pinned([h.binary("kv-indexer-loadgen"), "--endpoint", ports.url("server", 0), *common,
                               "--no-preload", "--router-client", endpoints, "--concurrency",
                               str(args.concurrency), "--duration-secs", str(args.seconds),
                               "--json-out", out], args.client_cpus),
                       check=True, capture_output=True)
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        client_cores = ((cpu_after.ru_utime + cpu_after.ru_stime) -
                        (cpu_before.ru_utime + cpu_before.ru_stime)) / args.seconds
        shares = [prefix_answers(a) - b for a, b in zip(admins, before)]
        with open(out) as f:
            report = json.loads(f.readlines()[-1])
        total = sum(shares) or 1
        return {"replicas": replicas, "answered_per_s": report["answered_per_s"],
                "p50_us": report["answered_p50_us"], "p99_us": report["answered_p99_us"],
                "failed_per_s": report["failed_per_s"], "client_cores": client_cores,
                "shares": [s / total for s in shares]}
    finally:
        h.stop([p.popen for p in procs])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-blocks", type=int, default=128)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--server-cpus", default="", help="taskset CPU list of the replicas (default: none)")
    ap.add_argument("--client-cpus", default="", help="taskset CPU list of the load generator (default: none)")
    ap.add_argument("--bin-dir", default=None)
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()
    h.require_redis(ap)
    h.build(args, "sgl-kv-indexer", "kv-indexer-tools", binaries=("kv-indexer-server", "kv-indexer-loadgen"))
    logs = tempfile.mkdtemp(prefix="kv-replicas-bench-")
    ports = h.Ports(0)
    rows = {1: [], 2: []}
    for run in range(args.runs):
        for replicas in (1, 2):
            row = measure(args, logs, ports, replicas, f"{run}-{replicas}")
            rows[replicas].append(row)
            print(json.dumps(row), flush=True)
    print(f"\nmedians of {args.runs} interleaved runs, {args.seconds} s each, concurrency {args.concurrency}, "
          f"{args.prompt_blocks}-block prompts, replicas on cpus {args.server_cpus or 'any'}, client on "
          f"{args.client_cpus or 'any'} ({os.cpu_count()} online):")
    med = {}
    for replicas, runs in rows.items():
        med[replicas] = {key: statistics.median(r[key] for r in runs)
                         for key in ("answered_per_s", "p50_us", "p99_us", "failed_per_s", "client_cores")}
        shares = [statistics.median(r["shares"][k] for r in runs) for k in range(replicas)]
        print(f"  {replicas} replica(s): {med[replicas]['answered_per_s']:.0f} answers/s, p50 "
              f"{med[replicas]['p50_us']:.0f} us, p99 {med[replicas]['p99_us']:.0f} us, failed "
              f"{med[replicas]['failed_per_s']:.1f}/s, client {med[replicas]['client_cores']:.2f} cores; shares "
              + ", ".join(f"{s:.1%}" for s in shares))
    print(f"  two/one: answers/s {med[2]['answered_per_s'] / med[1]['answered_per_s']:.2f}x, "
          f"p99 {med[2]['p99_us'] / med[1]['p99_us']:.2f}x")
    print(f"logs: {logs}")
    return 0


if __name__ == "__main__":
    h.run_main(main)
