#!/usr/bin/env python3
"""Prefix answers/s over gRPC with applies flowing, and the CPU each process used.

Starts `kv-indexer-server` pinned to --server-cpus, a churn generator (the preload, then
--ingest-ops block-ops/s of REPORT/REVOKE to the apply listener) and a query generator (as many
prefix queries as --concurrency allows), both pinned to --generator-cpus, and reads each
process's CPU time from /proc over the middle of the run. The CPU shares say who the limit
was: a server near its CPUs' count is saturated; a generator near 1.0 is the limit itself.

    scripts/grpc_cores.py --server-cpus 0            # one server core
    scripts/grpc_cores.py --server-cpus 0,1          # two (the generators share CPU 1)

Needs the release binaries (cargo build --release --bin kv-indexer-server --bin
kv-indexer-loadgen) in target/release, as the other scripts.
"""

import argparse
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fault_tests import BIN  # noqa: E402  (the scripts' shared helpers)
from overload import cpu_times, pinned  # noqa: E402  (CPU by thread role, from /proc)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    """CPU seconds of `pid` by thread role (see overload.THREADS)."""
    return cpu_times(pid)[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server-cpus", default="0")
    p.add_argument("--generator-cpus", default="1")
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--prompt-blocks", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--connections", type=int, default=2)
    p.add_argument("--ingest-ops", type=int, default=500_000)
    p.add_argument("--duration-s", type=int, default=10)
    args = p.parse_args()

    port, apply_port = free_port(), free_port()
    env = dict(os.environ, KV_INDEXER_LISTEN_ADDR=f"127.0.0.1:{port}",
               KV_INDEXER_APPLY_LISTEN_ADDR=f"127.0.0.1:{apply_port}")
    loadgen = pinned(args.generator_cpus, [
        os.path.join(BIN, "kv-indexer-loadgen"), "--endpoint", f"http://127.0.0.1:{port}",
        "--workers", str(args.workers), "--prompts", str(args.workers),
        "--prompt-blocks", str(args.prompt_blocks)])
    server = subprocess.Popen(pinned(args.server_cpus, [os.path.join(BIN, "kv-indexer-server")]),
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1)
        churn = subprocess.Popen(loadgen + [
            "--qps", "1", "--concurrency", "1", "--connections", "1",
            "--duration-secs", str(args.duration_s + 8), "--ingest-ops", str(args.ingest_ops),
            "--ingest-endpoint", f"http://127.0.0.1:{apply_port}"],
            stdout=subprocess.PIPE, text=True)
        time.sleep(5)  # the churn generator's preload
        queries = subprocess.Popen(loadgen + [
            "--qps", "0", "--concurrency", str(args.concurrency),
            "--connections", str(args.connections), "--duration-secs", str(args.duration_s),
            "--ingest-ops", "0", "--no-preload"], stdout=subprocess.PIPE, text=True)
        time.sleep(2)
        pids = {"server": server.pid, "query generator": queries.pid, "churn generator": churn.pid}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start = time.monotonic()
        time.sleep(max(1, args.duration_s - 4))
        elapsed = time.monotonic() - start
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        # Per process, and the server's by thread role.
        shares = {name: sum(after[name].values()) - sum(before[name].values()) for name in pids}
        roles = {role: max(0.0, used - before["server"].get(role, 0.0))
                 for role, used in after["server"].items()}
        query_report = queries.communicate()[0]
        churn_report = churn.communicate()[0]
    finally:
        server.terminate()
        server.wait()
    for line in query_report.splitlines():
        if line.startswith("prefix queries") or "OK:" in line:
            print(line)
    for line in churn_report.splitlines():
        if line.startswith("ingest:") or line.startswith("apply"):
            print(line)
    print(f"CPU over {elapsed:.0f} s: "
          + ", ".join(f"{n} {s / elapsed:.2f} cores" for n, s in shares.items()))
    print("server by thread: " + ", ".join(f"{r} {s / elapsed:.2f}" for r, s in sorted(roles.items())))


if __name__ == "__main__":
    main()
