#!/usr/bin/env python3
"""Prefix answers/s over gRPC with applies flowing, and the CPU each process used.

Starts `kv-indexer-server` pinned to --server-cpus, a churn generator (the preload, then
--ingest-ops block-ops/s of REPORT/REVOKE to the apply listener) and a query generator (as many
prefix queries as --concurrency allows), both pinned to --generator-cpus, and reads each
process's CPU time from /proc over the middle of the run. The CPU shares say who the limit
was: a server near its CPUs' count is saturated; a generator near 1.0 is the limit itself.

    scripts/grpc_cores.py --server-cpus 0            # one server core
    scripts/grpc_cores.py --server-cpus 0,1          # two (the generators share CPU 1)
    scripts/grpc_cores.py --server-cpus 0,1 --h2load --ingest-ops 0

--h2load sends the queries with h2load (Debian's nghttp2-client, installed by
scripts/install_h2load.sh): one pre-encoded prefix query (`kv-indexer-loadgen --write-query`,
a prompt the preload reported) sent over and over by one C thread, which costs far less CPU
than our generator, so that the server can have most of both cores. h2load sees HTTP, not
gRPC statuses: the script reads the server's own counters for what it answered and refused.

Needs the release binaries (cargo build --release --bin kv-indexer-server --bin
kv-indexer-loadgen) in target/release, as the other scripts.
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN  # noqa: E402  (the scripts' shared helpers)
from overload import cpu_times, pinned  # noqa: E402  (CPU by thread role, from /proc)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    """CPU seconds of `pid` by thread role (see overload.THREADS)."""
    return cpu_times(pid)[0]


def loadgen_queries(args, loadgen, port):
    return subprocess.Popen(loadgen + [
        "--qps", "0", "--concurrency", str(args.concurrency),
        "--connections", str(args.connections), "--duration-secs", str(args.duration_s),
        "--ingest-ops", "0", "--no-preload"], stdout=subprocess.PIPE, text=True)


def h2load_queries(args, loadgen, port):
    """h2load sending one pre-encoded prefix query at --concurrency streams over
    --connections connections; its report reformatted as the load generator's first lines."""
    body = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kv-query-{port}.grpc")
    subprocess.run(loadgen + ["--write-query", body], check=True)
    streams = max(1, args.concurrency // args.connections)
    argv = pinned(args.generator_cpus, [
        "h2load", "-t", "1", "-c", str(args.connections), "-m", str(streams),
        "-D", str(args.duration_s), "-d", body,
        "-H", "content-type: application/grpc", "-H", "te: trailers",
        f"http://127.0.0.1:{port}/kv_indexer.v1.KVIndexer/MatchExternalKvPrefix"])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def served(metrics_port):
    """The server's prefix queries so far by status code, from its /metrics (h2load sees only
    HTTP statuses)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    pattern = r'^kv_indexer_requests_total\{(?=[^}]*rpc="MatchExternalKvPrefix")[^}]*code="(\w+)"[^}]*\} (\S+)$'
    return {code: float(n) for code, n in re.findall(pattern, text, re.M)}


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
    p.add_argument("--h2load", action="store_true", help="send the queries with h2load (see above)")
    args = p.parse_args()

    port, apply_port, metrics_port = free_port(), free_port(), free_port()
    env = dict(os.environ, KV_INDEXER_LISTEN_ADDR=f"127.0.0.1:{port}",
               KV_INDEXER_APPLY_LISTEN_ADDR=f"127.0.0.1:{apply_port}",
               KV_INDEXER_METRICS_ADDR=f"127.0.0.1:{metrics_port}")
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
        queries = (h2load_queries if args.h2load else loadgen_queries)(args, loadgen, port)
        time.sleep(2)
        pids = {"server": server.pid, "query generator": queries.pid, "churn generator": churn.pid}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        codes_before = served(metrics_port)
        start = time.monotonic()
        time.sleep(max(1, args.duration_s - 4))
        elapsed = time.monotonic() - start
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        codes = {code: n - codes_before.get(code, 0.0) for code, n in served(metrics_port).items()}
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
        if line.startswith("prefix queries") or "OK:" in line or line.startswith(
                ("finished in", "requests:", "status codes:", "time for request:")):
            print(line)
    for line in churn_report.splitlines():
        if line.startswith("ingest:") or line.startswith("apply"):
            print(line)
    print(f"server's prefix answers/s over {elapsed:.0f} s: "
          + ", ".join(f"{code} {n / elapsed:.0f}" for code, n in sorted(codes.items()) if n))
    print(f"CPU over {elapsed:.0f} s: "
          + ", ".join(f"{n} {s / elapsed:.2f} cores" for n, s in shares.items()))
    print("server by thread: " + ", ".join(f"{r} {s / elapsed:.2f}" for r, s in sorted(roles.items())))


if __name__ == "__main__":
    main()
