#!/usr/bin/env python3
"""Overload run: prefix queries at ~10x what the server can serve, while applies keep flowing.

Starts a release `kv-indexer-server` on loopback and drives it with `kv-indexer-loadgen`
(real gRPC) in three phases, sampling the server's resident memory (VmRSS) throughout:

Applies go to the server's apply listener (KV_INDEXER_APPLY_LISTEN_ADDR, port + 1, a thread of
its own), as bridges should be deployed; --same-port sends them to the query port instead.

1. applies alone: the churn (REPORT then REVOKE of fresh blocks) with a trickle of queries,
   for the apply latency baseline;
2. capacity: queries as fast as --admission of them can run (concurrency = the server's
   admission bound, so none is refused), same churn: the answered rate is the capacity C;
3. overload: queries issued at --factor x C with --overload-concurrency in flight, same churn.

With two or more CPUs the server is pinned to CPU 0 and the load generator to CPU 1 (taskset),
so that the generator's own work never takes the server's CPU.

Latency is reported twice: as the generators see it (which includes their own queueing on a
saturated CPU and tonic's buffering) and as the server records it from the arrival of each
request's head to its answer (its Prometheus histogram; bucket bounds, so "p99 <= 5 ms").

What must hold in phase 3: no apply refused (applies are never shed) and apply latency near
phase 1; the surplus queries refused with RESOURCE_EXHAUSTED, in far less time than an answer
takes; the admitted queries' p99 bounded (near phase 2); memory flat.

    scripts/overload.py [--port 47600] [--duration-s 20] [--factor 10] [--no-build]

Only the Python standard library; the binaries are built with cargo (release) unless --no-build.
"""

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fault_tests import BIN, build, rss_mib  # noqa: E402  (the scripts' shared helpers)


class Sampler:
    """VmRSS of `pid` every `every` seconds, labelled with the phase running."""

    def __init__(self, pid, every=0.25):
        self.pid, self.every = pid, every
        self.phase = "start"
        self.samples = []  # (phase, MiB)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            try:
                self.samples.append((self.phase, rss_mib(self.pid)))
            except OSError:
                return
            time.sleep(self.every)

    def of(self, phase):
        return [m for p, m in self.samples if p == phase]


def pinned(cpu, argv):
    if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
        return ["taskset", "-c", str(cpu), *argv]
    return argv


def loadgen(args, ingest, **flags):
    """Starts one `kv-indexer-loadgen` on CPU 1: the churn of applies (`ingest`, a process of
    its own, like a bridge, so that it never queues behind the query generator's tasks) or the
    queries (no churn)."""
    argv = [f"{BIN}/kv-indexer-loadgen", "--endpoint", f"http://127.0.0.1:{args.port}",
            "--workers", str(args.workers), "--prompts", str(args.prompts),
            "--prompt-blocks", str(args.prompt_blocks), "--timeout-ms", str(args.timeout_ms),
            "--ingest-ops", str(args.ingest_ops if ingest else 0), "--ingest-batch", str(args.ingest_batch)]
    if ingest and not args.same_port:
        argv += ["--ingest-endpoint", f"http://127.0.0.1:{args.port + 1}"]
    for flag, value in flags.items():
        argv += [f"--{flag.replace('_', '-')}", str(value)]
    return subprocess.Popen(pinned(1, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def histograms(args):
    """{(rpc, code): {le: cumulative count}} of the server's request latency (from a request's
    arrival to its answer), scraped from its Prometheus endpoint."""
    url = f"http://127.0.0.1:{args.port + 2}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    found = {}
    for m in re.finditer(r'^kv_indexer_request_duration_seconds_bucket\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
        found.setdefault((labels["rpc"], labels["code"]), {})[le] = float(m.group(2))
    return found


def server_percentiles(before, after, key):
    """(count, p50 bound, p99 bound) in ms of one (rpc, code) between two scrapes: the upper
    bound of the bucket holding each percentile."""
    b, a = before.get(key, {}), after.get(key, {})
    les = sorted(a)
    counts = [a[le] - b.get(le, 0.0) for le in les]
    total = counts[-1] if counts else 0
    if total <= 0:
        return 0, None, None

    def bound(p):
        for le, c in zip(les, counts):
            if c >= p * total:
                return le * 1000
        return float("inf")

    return int(total), bound(0.5), bound(0.99)


def run_phase(args, duration, **query_flags):
    """Queries with `query_flags` for `duration` s while the churn runs (a little longer, so
    that it covers the whole query run); both reports, merged."""
    churn = loadgen(args, True, qps=1, concurrency=1, connections=1, duration_secs=duration + 4)
    time.sleep(1)
    before = histograms(args)
    queries = loadgen(args, False, duration_secs=duration, **query_flags)
    outputs = []
    for proc in (queries, churn):
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"loadgen failed: {out}\n{err}")
        outputs.append(out)
    after = histograms(args)
    r = parse(outputs[0])
    r["server"] = {key: server_percentiles(before, after, key) for key in after}
    applies = parse(outputs[1])
    for key in ("refused", "applies", "apply_p50", "apply_p99", "apply_max", "ingest_m"):
        if key in applies:
            r[key] = applies[key]
    return r


def parse(text):
    """The loadgen report as numbers."""
    r = {"outcomes": {}, "refused": "{}", "sent": 0, "sent_per_s": 0, "ok": 0, "ok_per_s": 0}
    m = re.search(r"prefix queries: (\d+) sent \((\d+)/s\), (\d+) ok \((\d+) ok/s\)", text)
    if m:
        r["sent"], r["sent_per_s"], r["ok"], r["ok_per_s"] = map(int, m.groups())
    for m in re.finditer(r"^\s+(\w+): +(\d+) \( *([\d.]+)%\)  latency µs p50 (\d+) p99 (\d+) p999 (\d+) max (\d+)",
                         text, re.M):
        name, n, pct, p50, p99, p999, mx = m.groups()
        r["outcomes"][name] = dict(n=int(n), pct=float(pct), p50=int(p50), p99=int(p99),
                                   p999=int(p999), max=int(mx))
    m = re.search(r"applies refused, by code: (.*)", text)
    if m:
        r["refused"] = m.group(1)
    m = re.search(r"apply \(REPORT or REVOKE\) latency µs over (\d+): p50 (\d+) p99 (\d+) max (\d+)", text)
    if m:
        r["applies"], r["apply_p50"], r["apply_p99"], r["apply_max"] = map(int, m.groups())
    m = re.search(r"ingest: ([\d.]+) M block-ops/s", text)
    r["ingest_m"] = float(m.group(1)) if m else 0.0
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=47600)
    ap.add_argument("--admission", type=int, default=32, help="the server's --prefix-query-max-inflight")
    ap.add_argument("--duration-s", type=int, default=20, help="per phase")
    ap.add_argument("--factor", type=float, default=10.0, help="offered load in multiples of capacity")
    ap.add_argument("--overload-concurrency", type=int, default=2048)
    ap.add_argument("--connections", type=int, default=48, help="64 streams each")
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-blocks", type=int, default=8192, help="long enough to run on the blocking pool")
    ap.add_argument("--ingest-ops", type=int, default=200_000, help="block-ops/s of churn")
    ap.add_argument("--ingest-batch", type=int, default=1024)
    ap.add_argument("--timeout-ms", type=int, default=1000, help="each query's grpc-timeout")
    ap.add_argument("--same-port", action="store_true",
                    help="send applies to the query port, not the server's apply listener")
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()

    build(args, "sgl-kv-indexer", "kv-indexer-tools")
    server = subprocess.Popen(pinned(0, [f"{BIN}/kv-indexer-server", "--listen-addr", f"127.0.0.1:{args.port}",
                                         "--apply-listen-addr", f"127.0.0.1:{args.port + 1}",
                                         "--metrics-addr", f"127.0.0.1:{args.port + 2}",
                                         "--prefix-query-max-inflight", str(args.admission)]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", args.port), timeout=0.2).close()
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError("the server did not start")
                time.sleep(0.05)
        sampler = Sampler(server.pid)
        d = args.duration_s
        phases = {}
        print("phase 1: applies alone …", file=sys.stderr, flush=True)
        sampler.phase = "applies"
        phases["applies"] = run_phase(args, d, qps=1, concurrency=1, connections=1)
        print("phase 2: capacity …", file=sys.stderr, flush=True)
        sampler.phase = "capacity"
        phases["capacity"] = run_phase(args, d, qps=0, concurrency=args.admission,
                                       connections=max(1, args.admission // 16))
        capacity = phases["capacity"]["ok_per_s"]
        offered = int(capacity * args.factor)
        print(f"phase 3: overload at {offered}/s ({args.factor:g} x {capacity}/s) …", file=sys.stderr, flush=True)
        sampler.phase = "overload"
        phases["overload"] = run_phase(args, d, qps=offered, concurrency=args.overload_concurrency,
                                       connections=args.connections)
        sampler.phase = "end"
        time.sleep(1)
        sampler.stop.set()
    finally:
        server.terminate()
        server.wait(timeout=10)

    print()
    print(f"server: --prefix-query-max-inflight {args.admission}; applies to "
          f"{'the query port' if args.same_port else 'the apply listener'}; {args.prompts} prompts of "
          f"{args.prompt_blocks} blocks held by {args.workers} workers; churn {args.ingest_ops} "
          f"block-ops/s in applies of {args.ingest_batch}; {d} s a phase")
    print(f"{'phase':<9} {'offered/s':>9} {'answered/s':>10} {'ok p50/p99 ms':>14} "
          f"{'refused':>8} {'refused p50/p99 ms':>18} {'applies':>8} {'apply p50/p99 ms':>16} "
          f"{'applies refused':>15} {'ingest M/s':>10} {'rss MiB min-max':>16}")
    for name, r in phases.items():
        ok = r["outcomes"].get("OK", {})
        rej = r["outcomes"].get("ResourceExhausted", {})
        rss = sampler.of(name)
        fmt = lambda o: f"{o['p50'] / 1000:.2f}/{o['p99'] / 1000:.2f}" if o else "-"
        print(f"{name:<9} {r['sent_per_s']:>9} {r['ok_per_s']:>10} {fmt(ok):>14} "
              f"{rej.get('n', 0):>8} {fmt(rej):>18} {r.get('applies', 0):>8} "
              f"{r.get('apply_p50', 0) / 1000:.2f}/{r.get('apply_p99', 0) / 1000:.2f}".ljust(0)
              + f" {r['refused']:>15} {r['ingest_m']:>10.2f} "
              f"{min(rss, default=0):>7.0f}-{max(rss, default=0):<7.0f}")
        others = {k: v["n"] for k, v in r["outcomes"].items() if k not in ("OK", "ResourceExhausted")}
        if others:
            print(f"          other query outcomes at the client: {others}")
        seen = ", ".join(f"{rpc} {code} {n} (p50 <= {p50:g} ms, p99 <= {p99:g} ms)"
                         for (rpc, code), (n, p50, p99) in sorted(r["server"].items()) if n)
        print(f"          at the server, arrival to answer: {seen}")
    over = phases["overload"]
    failed = over["refused"] != "{}" or phases["applies"]["refused"] != "{}"
    print("applies refused under overload: " + ("NONE" if not failed else over["refused"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
