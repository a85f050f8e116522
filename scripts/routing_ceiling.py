#!/usr/bin/env python3
"""How high can routing lift the hit rate? An offline replay of the routing benchmark's model.

`scripts/routing_bench.py` measures policies through the real router, Indexer and simulated
workers. This script replays the same trace through a model of the same fleet, in-process and in
seconds, to answer what the live benchmark cannot: the ceiling that routing alone can reach, and
what stands between the policies and the trace's reuse. Per trace it prints (and with --out
writes) one table:

- the policies, each routing onto W workers whose caches evict least recently used, as the
  simulated worker does: `exact` (the longest match in the workers' caches, ties and misses by
  the least prefill wait: what the Indexer and the oracle policies see), `radix` (the same rule
  on the router's own memory of what it sent where, bounded like the router's tree, never told of
  evictions), `round_robin`, and two tried to beat them: `min_wait` (the worker with the lowest
  estimated time to first token, queue plus its own prefill; `--wait-weight` scales the prefill
  part) and `split_fresh_K` (prompts with no usable match only to the first K workers, to keep
  one-shot prompts from flushing the others' caches);
- what is known of a prompt on arrival that could tell a router its blocks will be reused: the
  share of its blocks that a later prompt holds again, by length and by first or later turn;
- the bounds: `pooled LRU` (one cache of W x C tokens, least recently used), `pooled OPT`
  (Belady: one cache of W x C that evicts the block used furthest in the future, and keeps
  nothing it will never use again), `infinite` (every block ever seen).

The model, and where it is coarser than the live benchmark: caches hold 512-token blocks (the
trace's hash ids; the simulated worker holds 16-token pages, which only matters for a prompt's
last partial block); a prompt touches its blocks so that its prefix is evicted after its
suffix (the simulated worker evicts leaves first); prefill waits follow docs/routing-bench.md
(40 us per uncached token plus 1.3 us per uncached token per 1,000 tokens before it, one
prefill at a time per worker) at the offered load's arrival times; a prompt's blocks enter the
cache when it arrives. The live figures it should agree with are in bench/routing/*.md.

    scripts/routing_ceiling.py [--traces conversation,synthetic,shared-prefix] [--requests 2000]
                               [--workers 8] [--cache-tokens 262144] [--load 0.7]
                               [--radix-max-tokens 4000000] [--wait-weight 4]
                               [--out bench/routing/ceiling.md]
"""

import argparse
import heapq
import os
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import routing_bench  # noqa: E402  (the live benchmark: its traces and time model)

BLOCK = routing_bench.BLOCK_TOKENS
MODEL = routing_bench.TimeModel(argparse.Namespace(
    prefill_us_per_token=routing_bench.PREFILL_US_PER_TOKEN,
    attention_us_per_token_per_1k=routing_bench.ATTENTION_US_PER_TOKEN_PER_1K,
    decode_ms_per_token=0, speedup=1))
# The router's default --cache-affinity-min-matched-tokens (1024); --radix-max-tokens is set in main.
MIN_MATCHED_BLOCKS = 1024 // BLOCK
RADIX_BLOCKS = None
# The live benchmark's decode time per output token (its --decode-ms-per-token), model seconds.
DECODE_S_PER_TOKEN = 0.010


def prefill_s(uncached, cached):
    """The live benchmark's prefill time (docs/routing-bench.md), in model seconds."""
    return MODEL.prefill(cached, uncached)


def cached_tokens(blocks, request):
    return min(blocks * BLOCK, request["input_length"])


class Lru:
    """Blocks in least-recently-used order; a prompt's prefix counts as used after its suffix."""

    def __init__(self, capacity):
        self.blocks = OrderedDict()
        self.capacity = capacity

    def match(self, ids):
        n = 0
        for h in ids:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, ids):
        for h in reversed(ids):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class Worker:
    def __init__(self, capacity):
        self.cache = Lru(capacity)
        self.busy_until = 0.0
        self.ends = []  # a heap of when each request sent here ends (prefill, then its decode)

    def wait(self, now):
        return max(0.0, self.busy_until - now)

    def active(self, now):
        while self.ends and self.ends[0] <= now:
            heapq.heappop(self.ends)
        return len(self.ends)


def least_wait(workers, candidates, now):
    """The router's least loaded: prefill wait, then active requests, then order."""
    return min(candidates, key=lambda i: (workers[i].wait(now), workers[i].active(now), i))


def longest_match(workers, matches, now):
    """The router's cache_aware rule: the longest usable match, ties and misses by wait."""
    best = max(matches)
    if best >= MIN_MATCHED_BLOCKS:
        return least_wait(workers, [i for i, m in enumerate(matches) if m == best], now)
    return least_wait(workers, range(len(workers)), now)


def exact(workers, request, now, state):
    return longest_match(workers, [w.cache.match(request["hash_ids"]) for w in workers], now)


def radix(workers, request, now, state):
    """The same rule on what the router sent where: (worker, block) pairs, LRU-bounded."""
    memory = state.setdefault("radix", Lru(RADIX_BLOCKS))
    ids = request["hash_ids"]
    matches = []
    for i in range(len(workers)):
        n = 0
        for h in ids:
            if (i, h) not in memory.blocks:
                break
            n += 1
        matches.append(n)
    chosen = longest_match(workers, matches, now)
    memory.insert([(chosen, h) for h in ids])
    return chosen


def balanced(abs_threshold, rel_threshold):
    """`exact` with the router's balance guard (--balance-abs-threshold, --balance-rel-threshold):
    the cache choice gives way to the least active worker when its active requests exceed the
    mean by more than both thresholds."""
    def policy(workers, request, now, state):
        chosen = exact(workers, request, now, state)
        active = [w.active(now) for w in workers]
        mean = sum(active) / len(active)
        if active[chosen] > mean + abs_threshold and active[chosen] > mean * rel_threshold:
            return least_wait(workers, range(len(workers)), now)
        return chosen

    return policy


def round_robin(workers, request, now, state):
    state["next"] = state.get("next", -1) + 1
    return state["next"] % len(workers)


def min_wait(weight):
    def policy(workers, request, now, state):
        def estimate(i):
            cached = cached_tokens(workers[i].cache.match(request["hash_ids"]), request)
            own = prefill_s(request["input_length"] - cached, cached)
            return (workers[i].wait(now) + weight * own, i)

        return min(range(len(workers)), key=estimate)

    return policy


def split_fresh(k):
    def policy(workers, request, now, state):
        matches = [w.cache.match(request["hash_ids"]) for w in workers]
        if max(matches) >= MIN_MATCHED_BLOCKS:
            return longest_match(workers, matches, now)
        return least_wait(workers, range(k), now)

    return policy


def replay(requests, policy, workers, cache_tokens, load):
    fleet = [Worker(cache_tokens // BLOCK) for _ in range(workers)]
    capacity_rps = workers / (sum(prefill_s(r["input_length"], 0) for r in requests) / len(requests))
    start = requests[0]["timestamp"]
    span_s = (requests[-1]["timestamp"] - start) / 1000
    stretch = (len(requests) / span_s) / (load * capacity_rps)
    hit = total = 0
    ttfts = []
    routed = [0] * workers
    state = {}
    for r in requests:
        now = (r["timestamp"] - start) / 1000 * stretch
        i = policy(fleet, r, now, state)
        worker = fleet[i]
        cached = cached_tokens(worker.cache.match(r["hash_ids"]), r)
        worker.busy_until = max(now, worker.busy_until) + prefill_s(r["input_length"] - cached, cached)
        ttfts.append(worker.busy_until - now)
        heapq.heappush(worker.ends, worker.busy_until + r["output_length"] * DECODE_S_PER_TOKEN)
        worker.cache.insert(r["hash_ids"])
        hit += cached
        total += r["input_length"]
        routed[i] += 1
    ttfts.sort()
    p90 = ttfts[int(0.9 * (len(ttfts) - 1))]
    return {"hit": hit / total, "ttft_p90": p90, "spread": max(routed) * workers / sum(routed)}


def pooled_lru(requests, blocks):
    cache = Lru(blocks)
    hit = total = 0
    for r in requests:
        hit += cached_tokens(cache.match(r["hash_ids"]), r)
        total += r["input_length"]
        cache.insert(r["hash_ids"])
    return hit / total


def pooled_opt(requests, blocks):
    """Belady with bypass: evict the block whose next use is furthest (never = first)."""
    never = len(requests)
    next_use = []
    seen = {}
    for i in range(len(requests) - 1, -1, -1):
        next_use.append([seen.get(h, never) for h in requests[i]["hash_ids"]])
        for h in requests[i]["hash_ids"]:
            seen[h] = i
    next_use.reverse()
    cache = {}
    heap = []
    hit = total = 0
    for i, r in enumerate(requests):
        n = 0
        for h in r["hash_ids"]:
            if h not in cache:
                break
            n += 1
        hit += cached_tokens(n, r)
        total += r["input_length"]
        for h, use in zip(r["hash_ids"], next_use[i]):
            cache[h] = use
            heapq.heappush(heap, (-use, h))
        while len(cache) > blocks:
            use, h = heapq.heappop(heap)
            if cache.get(h) == -use:
                del cache[h]
    return hit / total


def reuse_by_class(requests):
    """The share of a prompt's blocks that a later prompt holds again, by what is known of the
    prompt when it arrives: its length, and whether it extends an earlier prompt (a later turn)."""
    last_holder = {}
    reused = [0] * len(requests)
    for i, r in enumerate(requests):
        for h in r["hash_ids"]:
            if h in last_holder:
                reused[last_holder[h]] += 1
            last_holder[h] = i
    seen = set()
    classes = {}
    for i, r in enumerate(requests):
        ids = r["hash_ids"]
        earlier = next((n for n, h in enumerate(ids) if h not in seen), len(ids))
        turn = "later turn" if earlier >= MIN_MATCHED_BLOCKS else "first turn"
        size = f"{min(r['input_length'] // 16384, 4) * 16}k+ tokens"
        for key in (turn, size):
            blocks, again = classes.get(key, (0, 0))
            classes[key] = (blocks + len(ids), again + reused[i])
        seen.update(ids)
    return ", ".join(f"{key} {again / blocks:.2f}" for key, (blocks, again) in sorted(classes.items()))


def table(name, requests, args):
    blocks = args.workers * args.cache_tokens // BLOCK
    policies = [
        ("exact (Indexer, oracle)", exact),
        ("radix", radix),
        ("round_robin", round_robin),
        (f"min_wait (weight {args.wait_weight:g})", min_wait(args.wait_weight)),
    ] + [(f"split_fresh_{k}", split_fresh(k)) for k in (args.workers - 1, args.workers - 2)] + [
        (f"exact, balance guard {args.balance_abs:g} / {args.balance_rel:g}x",
         balanced(args.balance_abs, args.balance_rel))]
    rows = [(label, replay(requests, p, args.workers, args.cache_tokens, args.load))
            for label, p in policies]
    radix_hit = dict(rows)["radix"]["hit"]
    lines = [
        f"### {name}: first {len(requests)} requests, {args.workers} workers, "
        f"{args.cache_tokens:,} cached tokens each, {args.load:.0%} load",
        "",
        "| routing | hit rate | / radix | TTFT p90 s | load max/mean |",
        "|---|---|---|---|---|",
    ]
    for label, r in rows:
        lines.append(f"| {label} | {r['hit']:.3f} | {r['hit'] / radix_hit:.2f} | "
                     f"{r['ttft_p90']:.2f} | {r['spread']:.2f} |")
    infinite = pooled_lru(requests, 1 << 62)
    for label, hit in [(f"pooled LRU ({blocks:,} blocks)", pooled_lru(requests, blocks)),
                       (f"pooled OPT ({blocks:,} blocks)", pooled_opt(requests, blocks)),
                       ("infinite", infinite)]:
        lines.append(f"| bound: {label} | {hit:.3f} | {hit / radix_hit:.2f} | | |")
    lines.append("")
    lines.append(f"1.25 x radix = {1.25 * radix_hit:.3f}. Share of a prompt's blocks reused later, "
                 f"by class: {reuse_by_class(requests)}.")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="conversation,synthetic")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--cache-tokens", type=int, default=262_144)
    p.add_argument("--load", type=float, default=0.7)
    p.add_argument("--wait-weight", type=float, default=4.0)
    p.add_argument("--radix-max-tokens", type=int, default=4_000_000,
                   help="what the radix policy remembers (the router's --radix-max-tokens)")
    p.add_argument("--balance-abs", type=float, default=4, help="the balance guard's absolute threshold")
    p.add_argument("--balance-rel", type=float, default=1.25, help="the balance guard's relative threshold")
    p.add_argument("--groups", type=int, default=32, help="shared-prefix: system prompts")
    p.add_argument("--zipf", type=float, default=0.8, help="shared-prefix: group popularity")
    p.add_argument("--out", help="also write the tables to this markdown file")
    args = p.parse_args()
    global RADIX_BLOCKS
    RADIX_BLOCKS = args.radix_max_tokens // BLOCK
    out = []
    for name in args.traces.split(","):
        name, requests = routing_bench.load_requests(name, args.requests,
                                                     {"groups": args.groups, "zipf": args.zipf})
        out.append(table(name, requests, args))
        print(out[-1], flush=True)
        print()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(out) + "\n")


if __name__ == "__main__":
    main()
