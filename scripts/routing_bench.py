#!/usr/bin/env python3
"""Routing benchmark in the regime where prefill matters: replay a Mooncake trace through the
router to simulated SGLang workers whose prefill cost grows with the uncached tokens, at offered
loads from 30 % to 90 % of the fleet's capacity, once per policy, and report what each policy buys.

For each trace, load and policy it starts a fresh Indexer, N simulated workers (`kv-indexer-sim`)
with their bridges, and the router, all on loopback; replays the first --requests requests (each
trace hash id stands for 512 deterministic tokens, so equal ids give equal prefixes) with the
trace's arrival pattern stretched to the offered load; and reports, per policy:

- hit rate: cached / prompt tokens, as the workers report them;
- TTFT p50 / p90 / p99: client side, streaming (the first chunk comes when the prefill is done);
- output tokens/s: completion tokens over the time from the first request to the last answer;
- load max/mean: requests per worker, highest over mean (and the same for prefill tokens);
- Indexer / oracle and Indexer / radix tree hit-rate ratios.

Policies: `indexer` (cache_aware on the Indexer), `oracle` (the same policy fed the workers' own
cache views, read directly: perfect, instant knowledge, the ceiling), `radix_tree` (the same
policy on the router's local approximate tree), `round_robin`, `power_of_two`. `--variant
NAME=POLICY FLAGS...` adds a policy with extra router flags (to measure a rule), e.g.
`--variant 'no_affinity=indexer --conversation-affinity false'`.

The time model (GPU: H100 SXM; model: Llama-3.1-8B; see docs/routing-bench.md for the sources):
prefill 40 µs per uncached token (2 x 8.03 G FLOP per token at 40 % of 989 TFLOP/s) plus
1.3 µs per uncached token per 1,000 tokens of context before it (attention: 4 x 4,096 x 32
FLOP per token pair at the same rate), prefills one after another per worker; decode 10 ms per
output token beside them. Capacity = workers / mean prefill time of the trace's prompts with
nothing cached. The simulated GPUs run --speedup times faster than that model (so a run takes
1/speedup of the model's time) and every time reported is converted back to model time.

    scripts/routing_bench.py [--traces conversation,synthetic] [--loads 0.3,0.5,0.7,0.9]
                             [--requests 2000] [--out bench/routing]

Writes <out>/results.json, <out>/<trace>.md (the tables) and <out>/<trace>-hit-rate.png,
<out>/<trace>-ttft-p90.png; a run adds its rows to those of earlier runs in results.json
(replacing the same policy at the same load), so a variant can be measured later. Plots need matplotlib (`pip install -r scripts/requirements-bench.txt`;
without it the tables are still written). The binaries are built with cargo (release) into
$CARGO_TARGET_DIR (default target/).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_tests as ft  # noqa: E402  (waiting, health checks and stopping are shared)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = {
    "conversation": os.path.join(ROOT, "crates/kv-index/benches/data/conversation_trace.jsonl"),
    "synthetic": os.path.join(ROOT, "bench/traces/synthetic_trace.jsonl"),
}
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
BIN = os.path.join(TARGET, "release")
BLOCK_TOKENS = 512
PAGE = 16
# The time model's prefill constants (model time; docs/routing-bench.md), the flags' defaults.
PREFILL_US_PER_TOKEN = 40.0
ATTENTION_US_PER_TOKEN_PER_1K = 1.3

POLICIES = {
    "indexer": ["--policy", "cache_aware", "--kv-indexer-endpoint", "{indexer}"],
    "oracle": ["--policy", "cache_aware", "--cache-prefix-provider", "oracle"],
    "radix_tree": ["--policy", "cache_aware", "--cache-prefix-provider", "radix_tree"],
    "round_robin": ["--policy", "round_robin"],
    "power_of_two": ["--policy", "power_of_two"],
}


def tokens_for(request):
    """Deterministic token ids: hash id h gives tokens h*512 .. h*512+511 (all below 2^31)."""
    ids = []
    for h in request["hash_ids"]:
        base = h * BLOCK_TOKENS
        ids.extend(range(base, base + BLOCK_TOKENS))
    return ids[: request["input_length"]]


class TimeModel:
    """Model-time costs, in seconds; the simulated workers get them divided by the speedup."""

    def __init__(self, args):
        self.prefill_us = args.prefill_us_per_token
        self.attention_us = args.attention_us_per_token_per_1k
        self.decode_us = args.decode_ms_per_token * 1000
        self.speedup = args.speedup

    def prefill(self, cached, uncached):
        """As kv-indexer-sim's TimeModel::prefill."""
        pairs = uncached * cached + uncached * max(uncached - 1, 0) // 2
        return (uncached * self.prefill_us + pairs * self.attention_us / 1000) / 1e6

    def sim_flags(self):
        k = self.speedup
        return ["--prefill-us-per-token", f"{self.prefill_us / k:.6f}",
                "--prefill-us-per-token-per-1k-context", f"{self.attention_us / k:.6f}",
                "--decode-us-per-token", str(max(1, round(self.decode_us / k)))]


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


class Fleet:
    """A fresh Indexer, simulated workers with bridges, and a router for one policy."""

    def __init__(self, args, model, router_args, logs):
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
                "--host-capacity-tokens", str(args.host_capacity_tokens),
                "--max-running", str(args.max_running), "--stream-interval", str(args.stream_interval),
                *model.sim_flags()])
            env = dict(os.environ, KV_INDEXER_WORKER_ID=f"sim-{i}",
                       KV_INDEXER_WORKER_ADDRESS=f"http://127.0.0.1:{http_port}",
                       SGLANG_KV_EVENT_ENDPOINT=f"tcp://127.0.0.1:{events}",
                       SGLANG_KV_EVENT_TOPIC="kv-events", KV_INDEXER_ENDPOINT=f"http://{self.indexer}")
            self.start(logs, f"bridge-{i}", [f"{BIN}/kv-indexer-bridge"], env)
            self.urls.append(f"http://127.0.0.1:{http_port}")
        self.router = f"127.0.0.1:{port + 1}"
        extra = [a.replace("{indexer}", f"http://{self.indexer}") for a in router_args]
        self.start(logs, "router", [f"{BIN}/kv-indexer-router", "--listen-addr", self.router,
                                    "--worker-urls", ",".join(self.urls),
                                    "--cache-affinity-min-matched-tokens", str(args.min_matched_tokens),
                                    *extra])
        for url in [*self.urls, f"http://{self.router}"]:
            ft.wait_until(lambda url=url: ft.http_ok(f"{url}/health"), f"{url}/health")
        time.sleep(1.5)  # bridges subscribe; the router learns the block size

    def start(self, logs, name, argv, env=None):
        log = open(os.path.join(logs, f"{name}.log"), "w")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env))

    def stop(self):
        ft.stop(self.procs, timeout=10)


def one_request(router, body):
    """(worker, ttft, prompt tokens, cached tokens, completion tokens, end) of one streamed
    /generate; times in wall seconds."""
    req = urllib.request.Request(f"http://{router}/generate", data=body,
                                 headers={"content-type": "application/json"})
    start = time.time()
    ttft = None
    last = None
    with urllib.request.urlopen(req, timeout=600) as resp:
        worker = resp.headers.get("x-routed-worker", "?")
        for raw in resp:
            if not raw.startswith(b"data:"):
                continue
            if ttft is None:
                ttft = time.time() - start
            data = raw[5:].strip()
            if data == b"[DONE]":
                break
            last = data
    meta = json.loads(last).get("meta_info", {}) if last else {}
    end = time.time()
    return (worker, ttft if ttft is not None else end - start, meta.get("prompt_tokens", 0),
            meta.get("cached_tokens", 0), meta.get("completion_tokens", 0), end)


def percentile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run_policy(args, model, trace, requests, bodies, name, router_args, load, capacity):
    logs = tempfile.mkdtemp(prefix=f"routing-{trace}-{name}-{int(load * 100)}-")
    fleet = Fleet(args, model, router_args, logs)
    results = []
    failures = []
    lock = threading.Lock()
    # The trace's arrival pattern, stretched to `load` of capacity (model time), then sped up.
    t0 = requests[0]["timestamp"] / 1000.0
    span = requests[-1]["timestamp"] / 1000.0 - t0
    native_rate = (len(requests) - 1) / span
    stretch = native_rate / (load * capacity) / model.speedup
    start = time.time() + 0.5

    def fire(i):
        due = start + (requests[i]["timestamp"] / 1000.0 - t0) * stretch
        delay = due - time.time()
        if delay > 0:
            time.sleep(delay)
        try:
            out = one_request(fleet.router, bodies[i])
        except Exception as error:  # a failed request is reported, never dropped silently
            with lock:
                failures.append(repr(error))
            return
        with lock:
            results.append(out)

    try:
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            list(pool.map(fire, range(len(requests))))
    finally:
        fleet.stop()
    if failures:
        print(f"  {len(failures)} requests failed, first: {failures[0]} (logs: {logs})", file=sys.stderr)
    k = model.speedup
    prompt = sum(r[2] for r in results)
    cached = sum(r[3] for r in results)
    ttfts = sorted(r[1] * k for r in results)
    makespan = (max(r[5] for r in results) - start) * k
    per_worker = {u: 0 for u in fleet.urls}
    prefill = {u: 0 for u in fleet.urls}
    for r in results:
        per_worker[r[0]] = per_worker.get(r[0], 0) + 1
        prefill[r[0]] = prefill.get(r[0], 0) + r[2] - r[3]
    counts = [per_worker[u] for u in fleet.urls]
    work = [prefill[u] for u in fleet.urls]
    return {
        "trace": trace,
        "policy": name,
        "load": load,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttfts, 0.50),
        "ttft_p90_s": percentile(ttfts, 0.90),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "output_tokens_per_s": sum(r[4] for r in results) / makespan,
        "load_max_over_mean": max(counts) / statistics.mean(counts),
        "prefill_max_over_mean": max(work) / statistics.mean(work) if any(work) else 0.0,
        "requests": len(results),
        "failed": len(failures),
        "logs": logs,
    }


def table(rows, bound, capacity, args, trace, model):
    by = {(r["policy"], r["load"]): r for r in rows}
    lines = [f"### {trace} trace: first {args.requests} requests, {args.workers} workers, "
             f"{args.capacity_tokens:,} cached tokens each",
             "",
             f"Capacity {capacity:.2f} requests/s (model time); infinite-cache hit rate {bound:.3f}; "
             f"simulated {model.speedup:g}x faster than the model, times in model seconds.",
             "",
             "| load | policy | hit rate | TTFT p50 s | TTFT p90 s | TTFT p99 s | output tok/s | "
             "load max/mean | prefill max/mean | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    loads = sorted({r["load"] for r in rows})
    for load in loads:
        for r in [r for r in rows if r["load"] == load]:
            lines.append(f"| {load:.0%} | {r['policy']} | {r['hit_rate']:.3f} | {r['ttft_p50_s']:.2f} | "
                         f"{r['ttft_p90_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
                         f"{r['load_max_over_mean']:.2f} | {r['prefill_max_over_mean']:.2f} | {r['failed']} |")
    lines += ["", "| load | Indexer / oracle hit rate | Indexer / radix tree hit rate | "
              "lowest TTFT p90 |", "|---|---|---|---|"]
    for load in loads:
        ix, orc, rad = (by.get((p, load)) for p in ("indexer", "oracle", "radix_tree"))
        ratio = lambda a, b: f"{a['hit_rate'] / b['hit_rate']:.2f}" if a and b and b["hit_rate"] else "-"
        at_load = [r for r in rows if r["load"] == load]
        best = min(at_load, key=lambda r: r["ttft_p90_s"])
        lines.append(f"| {load:.0%} | {ratio(ix, orc)} | {ratio(ix, rad)} | {best['policy']} |")
    return "\n".join(lines) + "\n"


def plots(rows, trace, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -r scripts/requirements-bench.txt): no plots",
              file=sys.stderr)
        return []
    written = []
    for key, label, name, log in (("hit_rate", "cache hit rate", "hit-rate", False),
                                  ("ttft_p90_s", "TTFT p90 (s, model time)", "ttft-p90", True)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy in dict.fromkeys(r["policy"] for r in rows):
            points = sorted((r["load"], r[key]) for r in rows if r["policy"] == policy)
            ax.plot([p[0] * 100 for p in points], [p[1] for p in points], marker="o", label=policy)
        ax.set_xlabel("offered load (% of fleet capacity)")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.set_title(f"{trace} trace")
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = os.path.join(out, f"{trace}-{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", default="conversation,synthetic", help="names or .jsonl paths")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--loads", default="0.3,0.5,0.7,0.9", help="offered load, fractions of capacity")
    p.add_argument("--policies", default="indexer,oracle,radix_tree,round_robin,power_of_two")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=POLICY FLAGS",
                   help="an extra policy: a base policy with extra router flags")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--capacity-tokens", type=int, default=262_144, help="device cache per worker")
    p.add_argument("--host-capacity-tokens", type=int, default=0, help="host tier per worker")
    p.add_argument("--prefill-us-per-token", type=float, default=PREFILL_US_PER_TOKEN,
                   help="model time")
    p.add_argument("--attention-us-per-token-per-1k", type=float,
                   default=ATTENTION_US_PER_TOKEN_PER_1K, help="model time")
    p.add_argument("--decode-ms-per-token", type=float, default=10.0, help="model time")
    p.add_argument("--speedup", type=float, default=10.0, help="simulated GPUs run this much faster")
    p.add_argument("--max-new-tokens", type=int, default=0, help="cap on the trace's output lengths (0: none)")
    p.add_argument("--stream-interval", type=int, default=32)
    p.add_argument("--max-running", type=int, default=1024)
    p.add_argument("--min-matched-tokens", type=int, default=1024, help="the router's affinity threshold")
    p.add_argument("--concurrency", type=int, default=768, help="client threads (open loop below it)")
    p.add_argument("--base-port", type=int, default=42000)
    p.add_argument("--out", default=os.path.join(ROOT, "bench/routing"))
    p.add_argument("--no-build", action="store_true")
    args = p.parse_args()

    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "sgl-kv-indexer", "-p", "kv-indexer-sim",
                        "-p", "kv-indexer-router"], cwd=ROOT, check=True)
    policies = {name: POLICIES[name] for name in args.policies.split(",") if name}
    for variant in args.variant:
        name, _, spec = variant.partition("=")
        base, *flags = shlex.split(spec)
        policies[name] = POLICIES[base] + flags
    model = TimeModel(args)
    loads = [float(x) for x in args.loads.split(",")]
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, "results.json")
    everything = json.load(open(results_path)) if os.path.exists(results_path) else {}
    for trace in args.traces.split(","):
        path = TRACES.get(trace, trace)
        trace = os.path.basename(trace).removesuffix(".jsonl").removesuffix("_trace")
        with open(path) as f:
            requests = [json.loads(line) for _, line in zip(range(args.requests), f)]
        if len(requests) < args.requests:
            sys.exit(f"{path} holds {len(requests)} requests, fewer than --requests {args.requests}")
        capacity = args.workers / statistics.mean(model.prefill(0, r["input_length"]) for r in requests)
        bodies = []
        for r in requests:
            out = r["output_length"] if not args.max_new_tokens else min(r["output_length"], args.max_new_tokens)
            bodies.append(json.dumps({"input_ids": tokens_for(r), "stream": True,
                                      "sampling_params": {"max_new_tokens": max(1, out)}}).encode())
        rows = []
        for load in loads:
            for name, router_args in policies.items():
                print(f"{trace} at {load:.0%}: {name} …", file=sys.stderr, flush=True)
                row = run_policy(args, model, trace, requests, bodies, name, router_args, load, capacity)
                print(f"  hit rate {row['hit_rate']:.3f}, TTFT p90 {row['ttft_p90_s']:.2f} s",
                      file=sys.stderr, flush=True)
                rows.append(row)
        bound = upper_bound(requests)
        command = "scripts/routing_bench.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        # Rows of earlier runs on the same trace stay, unless this run measured the same
        # (policy, load) again.
        earlier = everything.get(trace, {})
        measured = {(r["policy"], r["load"]) for r in rows}
        rows = [r for r in earlier.get("rows", []) if (r["policy"], r["load"]) not in measured] + rows
        rows.sort(key=lambda r: r["load"])
        commands = earlier.get("commands", [earlier["command"]] if "command" in earlier else [])
        commands = [c for c in commands if c != command] + [command]
        text = table(rows, bound, capacity, args, trace, model)
        with open(os.path.join(args.out, f"{trace}.md"), "w") as f:
            f.write(text + "\nProduced by " + " then ".join(f"`{c}`" for c in commands) + ".\n")
        everything[trace] = {"capacity_rps": capacity, "infinite_cache_hit_rate": bound,
                             "commands": commands, "rows": rows}
        with open(results_path, "w") as f:
            json.dump(everything, f, indent=1)
        print(text)
        for png in plots(rows, trace, args.out):
            print(f"wrote {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
