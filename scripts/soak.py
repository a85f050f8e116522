#!/usr/bin/env python3
"""Soak run: simulated workers churning their caches for minutes; the Indexer's memory and size
must stay flat and, at the end, the index must equal the workers' own cache views.

Starts the fleet of `harness.py` (the Indexer, --workers simulated SGLang workers with small
device and host caches so that steady traffic evicts on both tiers, one bridge each, replay on)
and sends /generate traffic for --minutes. Every --sample-s it prints: elapsed time, requests
so far, the server's and the bridges' resident memory (VmRSS), the index's placements and
blocks (its Prometheus gauges) and the placements the workers hold (their /cache_view). At the
end the traffic stops and the index is compared with the workers' views (over-claims must be 0;
after a quiet period nothing is lost either, so under-claims should be 0 too).

    scripts/soak.py [--minutes 5] [--workers 4] [--base-port 26800] [--no-build]

Exit status 1 on an over-claim or when the server's memory in the last quarter of the run is
more than --max-growth above the first quarter's.
"""

import argparse
import os
import re
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HOST, Fleet, Traffic, add_fleet_args, build, rss_mib, run_main, settle, stop_all  # noqa: E402


def gauges(metrics_url):
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    found = {}
    for name in ("kv_indexer_placements", "kv_indexer_blocks", "kv_indexer_workers"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        found[name] = int(float(m.group(1))) if m else 0
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--sample-s", type=float, default=20.0)
    ap.add_argument("--max-growth", type=float, default=0.10, help="allowed server RSS growth, first to last quarter")
    add_fleet_args(ap, workers=4, base_port=26800, docs=64, capacity_tokens=8192, host_capacity_tokens=16384,
                   stable_s=4.0, deadline_s=60.0, poll_s=0.5, seed=11)
    args = ap.parse_args()

    build(args, "sgl-kv-indexer", "kv-indexer-tools")
    logs = tempfile.mkdtemp(prefix="kv-soak-")
    metrics_port = args.base_port + 1
    metrics_url = f"http://{HOST}:{metrics_port}/metrics"
    samples = []
    try:
        fleet = Fleet(args, logs, server_extra=("--metrics-addr", f"{HOST}:{metrics_port}"))
        traffic = Traffic(args, args.seed)
        stop, thread = traffic.background(fleet.urls)
        start = time.time()
        end = start + args.minutes * 60
        print(f"{'t_s':>6} {'requests':>9} {'errors':>6} {'server_MiB':>10} {'bridges_MiB':>11} "
              f"{'index_placements':>16} {'index_blocks':>12} {'worker_placements':>17}", flush=True)
        while True:
            time.sleep(min(args.sample_s, max(0.0, end - time.time())))
            fleet.check_alive()
            g = gauges(metrics_url)
            held = sum(len(v) for v in fleet.worker_views().values())
            row = dict(t=time.time() - start, requests=traffic.sent, errors=traffic.errors,
                       server=rss_mib(fleet.server.popen.pid),
                       bridges=sum(rss_mib(b.popen.pid) for b in fleet.bridges),
                       placements=g["kv_indexer_placements"], blocks=g["kv_indexer_blocks"], held=held)
            samples.append(row)
            print(f"{row['t']:>6.0f} {row['requests']:>9} {row['errors']:>6} {row['server']:>10.1f} "
                  f"{row['bridges']:>11.1f} {row['placements']:>16} {row['blocks']:>12} {row['held']:>17}",
                  flush=True)
            if time.time() >= end:
                break
        stop.set()
        thread.join(timeout=30)
        quiet = time.time()
        result = settle(fleet, traffic, quiet, args)
    finally:
        stop_all()

    quarter = max(1, len(samples) // 4)
    first = max(s["server"] for s in samples[:quarter])
    last = max(s["server"] for s in samples[-quarter:])
    growth = (last - first) / first if first else 0.0
    print()
    print(f"requests {traffic.sent} ({traffic.errors} errors) over {args.minutes:g} min, {args.workers} workers")
    print(f"server RSS: first quarter max {first:.1f} MiB, last quarter max {last:.1f} MiB ({growth:+.1%})")
    print(f"index placements: min {min(s['placements'] for s in samples)}, "
          f"max {max(s['placements'] for s in samples)}; workers hold at most "
          f"{max(s['held'] for s in samples)}")
    print(f"at the end: expected {result['expected']}, held {result['held']}, over-claimed {result['over']}, "
          f"under-claimed {result['under']}, converged {result['converge']:.2f} s after traffic stopped"
          + ("" if result["settled"] else " (DEADLINE)"))
    print(f"logs: {logs}")
    failed = result["over"] > 0 or growth > args.max_growth or not result["settled"]
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
