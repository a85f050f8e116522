#!/usr/bin/env python3
"""What the Indexer buys where fleets are: R gateways (routers) in front of one fleet, a gateway
restart, and a shared-system-prompt workload, each policy run with several seeds.

Built on `scripts/routing_bench.py` (its fleet, time model, traces and measures): per workload,
number of routers R and policy, it starts a fresh Indexer, simulated workers with their bridges
and R routers, sends request i to a router drawn at random (seeded), moves each arrival by up to
half the mean gap (seeded), and reports the median and range over the seeds of the hit rate,
TTFT p50/p90 and load max/mean (requests per worker). Policies:

- `indexer`: our router, cache_aware on the Indexer (one Indexer for all R routers);
- `radix_tree`: our router on its own approximate tree (one tree per router);
- `smg`, `smg_mesh`: the SGLang model gateway (`pip install smg`, into a venv this script makes),
  `--policy cache_aware` (its own tree per gateway), alone or with `--enable-mesh` tying the R
  gateways together;
- `*_own_load`: our router counting only what it sent itself (`--worker-load-interval-ms 0`),
  the behaviour before gateways polled the workers' load;
- `indexer_balanced`: `indexer` with the balance guard (`--balance-abs-threshold 2
  --balance-rel-threshold 1.25`), which gives a hot prefix a second home;
- `indexer_poll_50ms`, `indexer_poll_200ms`: `indexer` polling the workers' load every 50 or
  200 ms of model time instead of 100 (at the default 10x speedup);
- `indexer_no_predictions`, `oracle`: for the sibling bursts (`oracle` reads the workers' own
  cache views: perfect, instant knowledge).

`--restart` runs instead, at R = 4, one run per policy and seed where router 0 is killed (-9) and
started again halfway through; its hit rate over the next 200 requests sent to router 0 is
compared with the same requests in the run without the restart (same seed, from an earlier run).
The `bursts` workload (sibling bursts: `burst_requests`) reports the followers' hit rate, with
and without predictions (`indexer_no_predictions`), against the oracle's.

    scripts/gateways_bench.py [--workloads conversation,shared-prefix] [--routers 1,4,8]
                              [--policies indexer,radix_tree,smg,smg_mesh] [--seeds 1,2,3]
                              [--load 0.7] [--requests 2000] [--restart] [--out bench/routing]

Writes <out>/gateways.json (every row, kept across runs: a row measured again replaces its old
self), <out>/gateways.md and <out>/gateways-<workload>-<measure>.png.
"""

import argparse
import json
import random
import os
import shlex
import statistics
import subprocess
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import routing_bench as rb  # noqa: E402

POLICIES = {
    "indexer": rb.POLICIES["indexer"],
    "indexer_no_predictions": rb.POLICIES["indexer"] + ["--kv-indexer-prediction-ttl-ms", "0"],
    "oracle": rb.POLICIES["oracle"],
    "radix_tree": rb.POLICIES["radix_tree"],
    "indexer_own_load": rb.POLICIES["indexer"] + ["--worker-load-interval-ms", "0"],
    "indexer_balanced": rb.POLICIES["indexer"] + ["--balance-abs-threshold", "2", "--balance-rel-threshold", "1.25"],
    # The load poll every 50 or 200 ms of model time (at the default 10x speedup), against 100.
    "indexer_poll_50ms": rb.POLICIES["indexer"] + ["--worker-load-interval-ms", "5"],
    "indexer_poll_200ms": rb.POLICIES["indexer"] + ["--worker-load-interval-ms", "20"],
    "radix_tree_own_load": rb.POLICIES["radix_tree"] + ["--worker-load-interval-ms", "0"],
}
SMG_VERSION = "1.13.0"
SMG_VENV = os.path.expanduser("~/.cache/kv-indexer-smg-venv")
RESTART_WINDOW = 200


def key(row):
    return (row["trace"], row["policy"], row["routers"], row["seed"], bool(row.get("restart_at")))


def spread(values):
    """'median [min-max]' of `values`."""
    values = sorted(values)
    return f"{statistics.median(values):.3f} [{values[0]:.3f}-{values[-1]:.3f}]"


def window_hit_rate(row, gateway, after, count):
    """Hit rate of the first `count` answered requests sent to `gateway` from index `after` on,
    and their indexes."""
    picked = []
    for i, item in enumerate(row["per_request"]):
        if i >= after and item is not None and item[0] == gateway:
            picked.append(i)
            if len(picked) == count:
                break
    return rate(row, picked), picked


def rate(row, indexes):
    items = [row["per_request"][i] for i in indexes if row["per_request"][i] is not None]
    prompt = sum(p for _, p, _ in items)
    return sum(c for _, _, c in items) / prompt if prompt else 0.0


def restart_lines(rows):
    out = ["| workload | policy | seed | router 0 down s | hit rate, next 200 | same requests, no restart "
           "| ratio | 200 before the restart |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r.get("restart_at")), key=lambda r: (r["trace"], r["policy"], r["seed"])):
        base = next((b for b in rows if key(b) == (*key(r)[:4], False)), None)
        after, picked = window_hit_rate(r, 0, r["restart_at"], RESTART_WINDOW)
        same = rate(base, picked) if base else None
        before = rate(r, [i for i, item in enumerate(r["per_request"][:r["restart_at"]])
                          if item is not None and item[0] == 0][-RESTART_WINDOW:])
        ratio = f"{after / same:.2f}" if same else "-"
        out.append(f"| {r['trace']} | {r['policy']} | {r['seed']} | {r.get('down_s', 0):.1f} | {after:.3f} | "
                   f"{'-' if same is None else f'{same:.3f}'} | {ratio} | {before:.3f} |")
    return out


def tables(rows, commands):
    lines = ["# Several gateways, one fleet", "",
             "Produced by `scripts/gateways_bench.py` (how: its docstring). Each cell is the median "
             "and [range] over the seeds; hit rate as the workers report it, times in model seconds, "
             "load max/mean in requests per worker.", ""]
    plain = [r for r in rows if not r.get("restart_at")]
    for trace in dict.fromkeys(r["trace"] for r in plain):
        at = [r for r in plain if r["trace"] == trace]
        lines += [f"## {trace}", "",
                  "| policy | R | seeds | hit rate | TTFT p50 s | TTFT p90 s | load max/mean | failed |",
                  "|---|---|---|---|---|---|---|---|"]
        groups = {}
        for r in at:
            groups.setdefault((r["policy"], r["routers"]), []).append(r)
        for (policy, routers), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            lines.append(f"| {policy} | {routers} | {len(rs)} | {spread(r['hit_rate'] for r in rs)} | "
                         f"{spread(r['ttft_p50_s'] for r in rs)} | {spread(r['ttft_p90_s'] for r in rs)} | "
                         f"{spread(r['load_max_over_mean'] for r in rs)} | {sum(r['failed'] for r in rs)} |")
        lines += ["", ratio_lines(groups), ""]
    bursts = [r for r in plain if "followers_hit_rate" in r]
    if bursts:
        lines += ["## Sibling bursts: followers' hit rate (the leader of each burst excluded)", "",
                  "| policy | R | seeds | followers' hit rate | / oracle's |", "|---|---|---|---|---|"]
        groups = {}
        for r in bursts:
            groups.setdefault((r["policy"], r["routers"]), []).append(r["followers_hit_rate"])
        for (policy, routers), values in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            oracle = groups.get(("oracle", routers))
            ratio = f"{statistics.median(values) / statistics.median(oracle):.2f}" if oracle and statistics.median(oracle) else "-"
            lines.append(f"| {policy} | {routers} | {len(values)} | {spread(values)} | {ratio} |")
        lines.append("")
    if any(r.get("restart_at") for r in rows):
        lines += ["## A gateway restart (R = 4, router 0 killed with -9 halfway)", "", *restart_lines(rows), ""]
    lines.append("Produced by " + " then ".join(f"`{c}`" for c in commands) + ".")
    return "\n".join(lines) + "\n"


def ratio_lines(groups):
    """The Indexer's medians against its R = 1 figures and against the trees' at the same R."""
    med = {k: (statistics.median(r["hit_rate"] for r in rs), statistics.median(r["ttft_p90_s"] for r in rs))
           for k, rs in groups.items()}
    out = ["| R | indexer hit rate / its R = 1 | indexer / radix_tree hit rate | indexer / smg hit rate "
           "| indexer TTFT p90 / its R = 1 |", "|---|---|---|---|---|"]
    one = med.get(("indexer", 1))
    for routers in sorted({k[1] for k in med}):
        ix = med.get(("indexer", routers))
        if not ix:
            continue
        cell = lambda other, i: f"{ix[i] / other[i]:.2f}" if other and other[i] else "-"
        out.append(f"| {routers} | {cell(one, 0)} | {cell(med.get(('radix_tree', routers)), 0)} | "
                   f"{cell(med.get(('smg', routers)), 0)} | {cell(one, 1)} |")
    return "\n".join(out)


def plots(rows, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -r scripts/requirements-bench.txt): no plots", file=sys.stderr)
        return
    plain = [r for r in rows if not r.get("restart_at")]
    for trace in dict.fromkeys(r["trace"] for r in plain):
        for measure, label, name in (("hit_rate", "cache hit rate", "hit-rate"),
                                     ("ttft_p90_s", "TTFT p90 (s, model time)", "ttft-p90")):
            fig, ax = plt.subplots(figsize=(6, 4))
            for policy in dict.fromkeys(r["policy"] for r in plain if r["trace"] == trace):
                by_r = {}
                for r in plain:
                    if r["trace"] == trace and r["policy"] == policy:
                        by_r.setdefault(r["routers"], []).append(r[measure])
                xs = sorted(by_r)
                meds = [statistics.median(by_r[x]) for x in xs]
                ax.errorbar(xs, meds, yerr=[[m - min(by_r[x]) for x, m in zip(xs, meds)],
                                            [max(by_r[x]) - m for x, m in zip(xs, meds)]],
                            marker="o", capsize=3, label=policy)
            ax.set_xlabel("gateways (routers) R")
            ax.set_ylabel(label)
            ax.set_xscale("log", base=2)
            ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
            if measure == "ttft_p90_s":
                ax.set_yscale("log")
            ax.set_title(f"{trace}: median and range over seeds")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = os.path.join(out, f"gateways-{trace}-{name}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            print(f"wrote {path}", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="conversation,shared-prefix")
    p.add_argument("--routers", default="1,4,8")
    p.add_argument("--policies", default="indexer,radix_tree,smg,smg_mesh")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--load", type=float, default=0.7)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--restart", action="store_true",
                   help="only the gateway restart runs (R = 4), compared with the rows of runs without")
    p.add_argument("--groups", type=int, default=32, help="shared-prefix: system prompts")
    p.add_argument("--zipf", type=float, default=0.8, help="shared-prefix: group popularity")
    p.add_argument("--out", default=os.path.join(rb.ROOT, "bench/routing"))
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--only-first-gateway", action="store_true",
                   help="a control: every request to router 0, the other R - 1 routers idle")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=POLICY FLAGS",
                   help="a policy of a known one plus router flags, e.g. "
                        "'balanced_4=indexer --balance-abs-threshold 4'")
    rb.add_fleet_arguments(p)
    args = p.parse_args()
    for variant in args.variant:
        name, _, spec = variant.partition("=")
        base, *flags = shlex.split(spec)
        POLICIES[name] = POLICIES[base] + flags
    os.makedirs(args.out, exist_ok=True)
    if not args.no_build:
        rb.build()
    model = rb.TimeModel(args)
    policies = args.policies.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    routers_list = [int(r) for r in args.routers.split(",")]
    fresh = []
    for workload in args.workloads.split(","):
        if workload == "bursts":
            trace, requests, load = workload, burst_requests(args.requests), None
        else:
            trace, requests = rb.load_requests(workload, args.requests, {"groups": args.groups, "zipf": args.zipf})
            load = args.load
        capacity = rb.capacity_of(requests, model, args.workers)
        bodies = rb.request_bodies(requests, args.max_new_tokens, args.engine)
        if args.restart:
            runs = [(4, pol, s, args.requests // 2) for pol in policies for s in seeds]
        else:
            runs = [(r, pol, s, None) for r in routers_list for pol in policies for s in seeds
                    if not (pol == "smg_mesh" and r == 1)]
        for routers, policy, seed, restart_at in runs:
            print(f"{trace}: {policy}, R={routers}, seed {seed}{', restart' if restart_at else ''} …",
                  file=sys.stderr, flush=True)
            fleet_class, flags = fleet_for(policy, args.speedup)
            row = rb.run_policy(args, model, trace, requests, bodies, policy, flags, load, capacity,
                                routers=routers, seed=seed, restart_at=restart_at, fleet_class=fleet_class)
            row["restart_at"] = restart_at
            if workload == "bursts":
                row["followers_hit_rate"] = rate(row, [i for i, r in enumerate(requests) if r["sibling"] > 0])
            print(f"  hit rate {row['hit_rate']:.3f}, TTFT p90 {row['ttft_p90_s']:.2f} s, "
                  f"load max/mean {row['load_max_over_mean']:.2f}, failed {row['failed']}", file=sys.stderr, flush=True)
            fresh.append(row)
            save(args.out, fresh, command_line())
    save(args.out, fresh, command_line())
    plots(json.load(open(os.path.join(args.out, "gateways.json")))["rows"], args.out)


def command_line():
    return "scripts/gateways_bench.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def save(out, fresh, command):
    """Merges `fresh` rows into <out>/gateways.json (a row measured again replaces its old
    self) and rewrites gateways.md; called after every run, so a run that fails keeps the
    rows before it."""
    path = os.path.join(out, "gateways.json")
    saved = json.load(open(path)) if os.path.exists(path) else {"commands": [], "rows": []}
    measured = {key(r) for r in fresh}
    rows = [r for r in saved["rows"] if key(r) not in measured] + fresh
    commands = [c for c in saved["commands"] if c != command] + [command]
    with open(path, "w") as f:
        json.dump({"commands": commands, "rows": rows}, f)
    text = tables(rows, commands)
    with open(os.path.join(out, "gateways.md"), "w") as f:
        f.write(text)
    return text

def fleet_for(policy, speedup):
    """(the fleet class, router flags) of a policy name. Our routers' intervals are their
    defaults in the simulation's time: the workers' load polled every 100 ms and predictions
    kept 2 s, of model time."""
    if policy.startswith("smg"):
        ensure_smg()
        return (SmgMeshFleet if policy == "smg_mesh" else SmgFleet), []
    flags = list(POLICIES[policy])
    for flag, model_ms in (("--worker-load-interval-ms", 100), ("--kv-indexer-prediction-ttl-ms", 2000)):
        if flag not in flags:
            flags += [flag, str(max(1, round(model_ms / speedup)))]
    return rb.Fleet, flags


def burst_requests(count, siblings=8, prefix_blocks=8, suffix_tokens=256, spread_s=0.1, gap_s=0.37,
                   output_tokens=64, seed=0):
    """Sibling bursts (best-of-N, agent fan-out): every `gap_s` (model seconds) a new prefix of
    `prefix_blocks` x 512 tokens is sent `siblings` times, each with its own suffix, all within
    `spread_s`; the first of a burst is its leader, the others its followers. Times are model
    time (the default gap offers about half the 8 workers' uncached capacity)."""
    rng = random.Random(seed)
    requests = []
    for burst in range(-(-count // siblings)):
        start = burst * gap_s
        offsets = sorted(rng.uniform(0, spread_s) for _ in range(siblings))
        for k, offset in enumerate(offsets[:count - len(requests)]):
            prefix = [1_000_000 + burst * 16 + j for j in range(prefix_blocks)]
            suffix = [1_900_000 + (burst * siblings + k) * 2 + j for j in range(-(-suffix_tokens // rb.BLOCK_TOKENS))]
            requests.append({"timestamp": round((start + offset) * 1000), "hash_ids": prefix + suffix,
                             "input_length": prefix_blocks * rb.BLOCK_TOKENS + suffix_tokens,
                             "output_length": output_tokens, "sibling": k})
    return requests


def ensure_smg():
    """SMG from PyPI in a venv of its own (made once)."""
    smg = os.path.join(SMG_VENV, "bin", "smg")
    if not os.path.exists(smg):
        subprocess.run([sys.executable, "-m", "venv", SMG_VENV], check=True)
        subprocess.run([os.path.join(SMG_VENV, "bin", "pip"), "install", "-q", f"smg=={SMG_VERSION}"], check=True)
    return smg


class SmgFleet(rb.Fleet):
    """The fleet with SMG gateways in place of our routers (each in its own process group: `smg
    launch` runs the router in a child process)."""

    mesh = False

    def router_argv(self, i):
        host, port = self.routers[i].split(":")
        # Its defaults, but for the warm-up slice: 60 s of sending misses to "new" workers is
        # negligible in a fleet's life and would be the whole of a run here.
        argv = [os.path.join(SMG_VENV, "bin", "smg"), "launch", "--host", host, "--port", port,
                "--policy", "cache_aware", "--worker-urls", *self.urls, "--worker-warmup-secs", "0",
                "--prometheus-host", host, "--prometheus-port", str(int(port) + 300), "--log-level", "warn"]
        if self.mesh:
            mesh_port = lambda j: int(self.routers[j].split(":")[1]) + 400
            argv += ["--enable-mesh", "--mesh-server-name", f"gw{i}", "--mesh-host", host,
                     "--mesh-port", str(mesh_port(i)), "--mesh-peer-urls",
                     *[f"{host}:{mesh_port(j)}" for j in range(len(self.routers)) if j != i]]
        return argv

    def start_router(self, i):
        return self.start(f"router-{i}", self.router_argv(i), session=True)

    def wait_router(self, i):
        url = f"http://{self.routers[i]}/readiness"
        harness.wait_until(lambda: json.load(urllib.request.urlopen(url, timeout=1)).get("healthy_workers")
                      == len(self.urls), url)


class SmgMeshFleet(SmgFleet):
    mesh = True


if __name__ == "__main__":
    harness.run_main(main)
