#!/usr/bin/env python3
"""Routing-quality benchmark: replay the Mooncake conversation trace through the router to
simulated SGLang workers with finite caches, once per policy, and report what each policy buys.

For each policy (Indexer, local approximate radix tree, round robin, power of two) it starts a
fresh Indexer, N simulated workers with their bridges, and the router, all on loopback; replays
the first --requests requests with timestamps scaled by --time-scale (each trace hash id stands
for 512 deterministic tokens, so equal ids give equal prefixes); and reports the cache hit rate
(cached / prompt tokens, as the workers report them), mean and p99 time to first token (client
side, streaming), and the load spread (requests per worker). It also reports the upper bound a
single infinite cache would reach on the same requests.

    scripts/routing_bench.py [--requests 2000] [--time-scale 0.1] [--workers 8]

Only the Python standard library; the binaries are built with cargo (release).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "crates/kv-index/benches/data/conversation_trace.jsonl")
BIN = os.path.join(ROOT, "target/release")
BLOCK_TOKENS = 512
PAGE = 16


def tokens_for(request):
    """Deterministic token ids: hash id h gives tokens h*512 .. h*512+511 (all below 2^31)."""
    ids = []
    for h in request["hash_ids"]:
        base = h * BLOCK_TOKENS
        ids.extend(range(base, base + BLOCK_TOKENS))
    return ids[: request["input_length"]]


def upper_bound(requests):
    """Hit rate of one infinite cache: full pages of each prompt's longest prefix seen before."""
    seen = set()
    cached = prompt = 0
    for r in requests:
        prefix_blocks = 0
        for h in r["hash_ids"]:
            if h not in seen:
                break
            prefix_blocks += 1
        tokens = r["input_length"]
        hit = min(prefix_blocks * BLOCK_TOKENS, tokens)
        cached += hit - hit % PAGE
        prompt += tokens
        seen.update(r["hash_ids"])
    return cached / prompt


def wait_http(url, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except Exception:
            time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {url}")


class Fleet:
    """A fresh Indexer, simulated workers with bridges, and a router for one policy."""

    def __init__(self, args, policy, provider_args, logs):
        self.procs = []
        port = args.base_port
        self.indexer = f"127.0.0.1:{port}"
        self.start(logs, "server", [f"{BIN}/kv-indexer-server", "--listen-addr", self.indexer])
        self.urls = []
        for i in range(args.workers):
            http_port, events = port + 10 + i, port + 100 + i
            self.start(logs, f"sim-{i}", [
                f"{BIN}/kv-indexer-sim", "--port", str(http_port), "--kv-events-port", str(events),
                "--capacity-tokens", str(args.capacity_tokens),
                "--prefill-us-per-token", str(args.prefill_us), "--decode-us-per-token", str(args.decode_us),
                "--max-running", str(args.max_running)])
            env = dict(os.environ, KV_INDEXER_WORKER_ID=f"sim-{i}",
                       KV_INDEXER_WORKER_ADDRESS=f"http://127.0.0.1:{http_port}",
                       SGLANG_KV_EVENT_ENDPOINT=f"tcp://127.0.0.1:{events}",
                       SGLANG_KV_EVENT_TOPIC="kv-events", KV_INDEXER_ENDPOINT=f"http://{self.indexer}")
            self.start(logs, f"bridge-{i}", [f"{BIN}/kv-indexer-bridge"], env)
            self.urls.append(f"http://127.0.0.1:{http_port}")
        self.router = f"127.0.0.1:{port + 1}"
        extra = [a.replace("{indexer}", f"http://{self.indexer}") for a in provider_args]
        self.start(logs, "router", [f"{BIN}/kv-indexer-router", "--listen-addr", self.router,
                                    "--worker-urls", ",".join(self.urls), "--policy", policy,
                                    "--cache-affinity-min-matched-tokens", str(args.min_matched_tokens), *extra])
        for url in self.urls:
            wait_http(f"{url}/health")
        wait_http(f"http://{self.router}/health")
        time.sleep(1.5)  # bridges subscribe; the router learns the block size

    def start(self, logs, name, argv, env=None):
        log = open(os.path.join(logs, f"{name}.log"), "w")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env))

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def one_request(router, request, max_new_tokens):
    body = json.dumps({"input_ids": tokens_for(request), "stream": True,
                       "sampling_params": {"max_new_tokens": max_new_tokens}}).encode()
    req = urllib.request.Request(f"http://{router}/generate", data=body,
                                 headers={"content-type": "application/json"})
    start = time.time()
    ttft = None
    meta = {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        worker = resp.headers.get("x-routed-worker", "?")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            if ttft is None:
                ttft = time.time() - start
            data = line[5:].strip()
            if data == "[DONE]":
                break
            meta = json.loads(data).get("meta_info", meta)
    return worker, ttft or (time.time() - start), meta.get("prompt_tokens", 0), meta.get("cached_tokens", 0)


def run_policy(args, requests, name, policy, provider_args):
    logs = tempfile.mkdtemp(prefix=f"routing-{name}-")
    fleet = Fleet(args, policy, provider_args, logs)
    results = []
    lock = threading.Lock()
    t0 = requests[0]["timestamp"]
    start = time.time()

    def fire(r):
        due = start + (r["timestamp"] - t0) / 1000.0 * args.time_scale
        delay = due - time.time()
        if delay > 0:
            time.sleep(delay)
        out = one_request(fleet.router, r, min(r["output_length"], args.max_new_tokens))
        with lock:
            results.append(out)

    try:
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            list(pool.map(fire, requests))
    finally:
        fleet.stop()
    prompt = sum(r[2] for r in results)
    cached = sum(r[3] for r in results)
    ttfts = sorted(r[1] for r in results)
    per_worker = {}
    for r in results:
        per_worker[r[0]] = per_worker.get(r[0], 0) + 1
    counts = [per_worker.get(u, 0) for u in fleet.urls]
    return {
        "policy": name,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_mean_ms": statistics.mean(ttfts) * 1000,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1000,
        "load_max_over_mean": max(counts) / statistics.mean(counts) if any(counts) else 0.0,
        "load_cv": statistics.pstdev(counts) / statistics.mean(counts) if any(counts) else 0.0,
        "requests": len(results),
        "logs": logs,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--time-scale", type=float, default=0.1, help="trace seconds → wall seconds")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--capacity-tokens", type=int, default=262_144, help="device cache per worker")
    p.add_argument("--prefill-us", type=int, default=2, help="simulated µs per uncached prompt token")
    p.add_argument("--decode-us", type=int, default=1000, help="simulated µs per output token")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--min-matched-tokens", type=int, default=1024, help="the router's affinity threshold")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--base-port", type=int, default=42000)
    p.add_argument("--policies", default="indexer,radix_tree,round_robin,power_of_two")
    p.add_argument("--no-build", action="store_true")
    args = p.parse_args()

    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "sgl-kv-indexer", "-p", "kv-indexer-sim",
                        "-p", "kv-indexer-router"], cwd=ROOT, check=True)
    with open(TRACE) as f:
        requests = [json.loads(line) for _, line in zip(range(args.requests), f)]
    policies = {
        "indexer": ("cache_aware", ["--kv-indexer-endpoint", "{indexer}"]),
        "radix_tree": ("cache_aware", ["--cache-prefix-provider", "radix_tree"]),
        "round_robin": ("round_robin", []),
        "power_of_two": ("power_of_two", []),
    }
    rows = []
    for name in args.policies.split(","):
        policy, extra = policies[name]
        print(f"running {name} …", file=sys.stderr, flush=True)
        rows.append(run_policy(args, requests, name, policy, extra))
    bound = upper_bound(requests)
    print(f"\n{len(requests)} requests of the Mooncake conversation trace, {args.workers} workers, "
          f"{args.capacity_tokens} cached tokens each, time scale {args.time_scale}")
    print(f"{'policy':<14} {'hit rate':>9} {'TTFT mean ms':>13} {'TTFT p99 ms':>12} {'load max/mean':>14} {'load CV':>8}")
    for r in rows:
        print(f"{r['policy']:<14} {r['hit_rate']:>9.3f} {r['ttft_mean_ms']:>13.1f} {r['ttft_p99_ms']:>12.1f} "
              f"{r['load_max_over_mean']:>14.2f} {r['load_cv']:>8.2f}")
    print(f"{'infinite cache':<14} {bound:>9.3f}   (upper bound: one cache that never evicts)")


if __name__ == "__main__":
    main()
