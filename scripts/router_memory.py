#!/usr/bin/env python3
"""A router's memory over many requests with nobody scraping /metrics.

Starts the release binaries on loopback: an Indexer, simulated workers (zero prefill and decode
cost) with a bridge each, and the router with the Indexer as its cache signal. Sends
`--requests` `/generate` requests (prompts of token ids sharing prefixes, one new token each)
from a few keep-alive connections, never asks the router for /metrics, and samples the
router's resident memory (VmRSS of /proc/<pid>/status) every `--every` requests.

    cargo build --release -p sgl-kv-indexer -p kv-indexer-router
    scripts/router_memory.py [--requests 100000] [--every 10000] [--bin-dir target/release]

Python 3.11, standard library only. Linux (reads /proc). Ports: --base-port and up.
"""

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (waiting, health checks and stopping are shared)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Fleet:
    def __init__(self, args, logs):
        self.procs = []
        port = args.base_port
        self.indexer = f"127.0.0.1:{port}"
        self.start(logs, "server", [f"{args.bin_dir}/kv-indexer-server", "--listen-addr", self.indexer])
        urls = []
        for i in range(args.workers):
            http_port, events = port + 10 + i, port + 100 + i
            self.start(logs, f"sim-{i}", [
                f"{args.bin_dir}/kv-indexer-sim", "--port", str(http_port),
                "--kv-events-port", str(events), "--prefill-us-per-token", "0",
                "--decode-us-per-token", "0"])
            env = dict(os.environ, KV_INDEXER_WORKER_ID=f"sim-{i}",
                       KV_INDEXER_WORKER_ADDRESS=f"http://127.0.0.1:{http_port}",
                       SGLANG_KV_EVENT_ENDPOINT=f"tcp://127.0.0.1:{events}",
                       SGLANG_KV_EVENT_TOPIC="kv-events",
                       KV_INDEXER_ENDPOINT=f"http://{self.indexer}")
            self.start(logs, f"bridge-{i}", [f"{args.bin_dir}/kv-indexer-bridge"], env)
            urls.append(f"http://127.0.0.1:{http_port}")
        self.router_port = port + 1
        self.router = self.start(logs, "router", [
            f"{args.bin_dir}/kv-indexer-router", "--listen-addr", f"127.0.0.1:{self.router_port}",
            "--worker-urls", ",".join(urls), "--kv-indexer-endpoint", f"http://{self.indexer}",
            "--cache-affinity-min-matched-tokens", "32"])
        for url in urls:
            harness.wait_until(lambda url=url: harness.http_ok(f"{url}/health"), f"{url}/health")
        harness.wait_until(lambda: harness.http_ok(f"http://127.0.0.1:{self.router_port}/health"), "the router's /health")
        # The router asks the Indexer only once it has learned the block size.
        harness.wait_until(lambda: generate(self.connection(), [1, 2, 3])[1] != "hashing_unknown",
                      "the router to learn the block size")

    def connection(self):
        return http.client.HTTPConnection("127.0.0.1", self.router_port, timeout=30)

    def start(self, logs, name, argv, env=None):
        log = open(os.path.join(logs, f"{name}.log"), "w")
        proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env)
        self.procs.append(proc)
        return proc

    def stop(self):
        harness.stop(self.procs, timeout=10)


def generate(conn, tokens):
    body = json.dumps({"input_ids": tokens, "sampling_params": {"max_new_tokens": 1}})
    conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    if response.status != 200:
        raise RuntimeError(f"/generate answered {response.status}")
    return response.status, response.getheader("x-routing-reason")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--every", type=int, default=10_000, help="sample RSS every this many requests")
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--documents", type=int, default=200, help="distinct shared prefixes")
    p.add_argument("--base-port", type=int, default=22100)
    p.add_argument("--bin-dir", default=os.path.join(ROOT, "target", "release"))
    args = p.parse_args()

    logs = tempfile.mkdtemp(prefix="router-memory-")
    fleet = Fleet(args, logs)
    pid = fleet.router.pid
    lock = threading.Lock()
    sent = 0
    reasons = {}
    samples = [(0, rss_kib(pid))]
    errors = []

    def client(seed):
        nonlocal sent
        rng = random.Random(seed)
        conn = fleet.connection()
        while True:
            with lock:
                if sent >= args.requests or errors:
                    return
                sent += 1
                n = sent
            doc = rng.randrange(args.documents)
            tokens = [doc * 100_000 + i for i in range(64)] + [rng.randrange(1 << 30) for _ in range(8)]
            try:
                _, reason = generate(conn, tokens)
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)
                return
            with lock:
                reasons[reason] = reasons.get(reason, 0) + 1
                if n % args.every == 0:
                    samples.append((n, rss_kib(pid)))

    started = time.time()
    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.connections)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        fleet.stop()
    elapsed = time.time() - started
    if errors:
        print(f"failed: {errors[0]} (logs in {logs})", file=sys.stderr)
        return 1
    print(f"router {args.bin_dir}/kv-indexer-router, {args.requests} requests in {elapsed:.0f} s "
          f"({args.requests / elapsed:.0f}/s), {args.connections} connections, no /metrics scrape")
    print(f"routing reasons: {dict(sorted(reasons.items()))}")
    print("requests  VmRSS_KiB")
    for n, kib in sorted(samples):
        print(f"{n:>8}  {kib:>9}")
    settled = [kib for n, kib in samples if n >= args.every]
    if len(settled) >= 2:
        print(f"growth from {args.every} to {samples[-1][0]} requests: {settled[-1] - settled[0]:+d} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
