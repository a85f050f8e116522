#!/usr/bin/env python3
"""Overload run: prefix queries at --factor x what the server can serve, while applies keep flowing.

Starts a release `kv-indexer-server` on loopback and drives it with `kv-indexer-loadgen`
(real gRPC) in four phases, sampling the server's resident memory (VmRSS) and the CPU time of
its threads throughout. Applies go to the server's apply listener (KV_INDEXER_APPLY_LISTEN_ADDR,
port + 1, a thread of its own, never bounded), as bridges should be deployed; --same-port sends
the churn to the query port instead.

1. applies alone: the churn (REPORT then REVOKE of fresh blocks) with a trickle of queries,
   for the apply latency baseline;
2. capacity: queries as fast as --admission of them can run (concurrency = the server's
   admission bound, so none is refused), same churn: the answered rate is the capacity C;
3. unloaded: queries at a tenth of C on as many of the overload's connections as the server
   serves, same churn: the latency of a query that waits for nothing (the "unloaded p99");
4. overload: queries issued at --factor x C on --connections connections with
   --overload-concurrency in flight, same churn. With --max-connections below --connections
   the generator runs on more connections than the server serves.

With two or more CPUs the server is pinned to CPU 0 and the load generator to CPU 1 (taskset),
so that the generator's own work never takes the server's CPU. Other processes on CPU 0 do:
the report gives the CPU time they took during each phase ("others").

Latency is reported twice: as the generator sees it (from sending a call to its answer) and as
the server records it from the arrival of each request's head to its answer (its Prometheus
histogram; bucket bounds, so "p99 <= 5 ms"). The CPU split says what limits the server: the
runtime's threads (HTTP/2: reading, refusing, decoding, encoding, per call) against the query
threads (the scans, per answer).

What must hold in phase 4: no apply refused (applies are never shed) and apply latency near
phase 1; the surplus refused at once; the admitted queries' p99 at most 2x the unloaded p99.

    scripts/overload.py [--factor 3] [--admission 4] [--max-connections 16] [--no-build]
                        [--label NAME --json-out runs.jsonl]

--json-out appends one JSON line per phase (the generator's report, labelled "NAME/phase",
plus the server's side), for scripts/compare_loadgen.py. Only the Python standard library;
the binaries are built with cargo (release) unless --no-build.
"""

import argparse
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, build, rss_mib  # noqa: E402  (the scripts' shared helpers)

# Thread names (15 characters at most, as the kernel keeps them) -> what they do.
THREADS = {"tokio-rt-worker": "runtime", "kv-indexer-quer": "queries",
           "kv-indexer-appl": "apply listener", "kv-indexer-writ": "writer"}


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


def cpu_times(pid):
    """(seconds of CPU by thread role, seconds CPU 0 was busy): clock ticks from /proc. Threads
    that have ended (the blocking pool's) count as "other", from the process's total."""
    tick = os.sysconf("SC_CLK_TCK")

    def seconds(path):
        with open(path) as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2:].split()
        return stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / tick

    by_role = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name, used = seconds(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        role = THREADS.get(name, "other")
        by_role[role] = by_role.get(role, 0.0) + used
    _, total = seconds(f"/proc/{pid}/stat")
    by_role["other"] = by_role.get("other", 0.0) + max(0.0, total - sum(by_role.values()))
    with open("/proc/stat") as f:
        cpu0 = next(line.split() for line in f if line.startswith("cpu0 "))
    busy = sum(int(cpu0[i]) for i in (1, 2, 3, 6, 7)) / tick
    return by_role, busy


def apply_port(args):
    return args.port if args.same_port else args.port + 1


def generator(args, port=None, **flags):
    """The `kv-indexer-loadgen` command line (on CPU 1) for this server and workload, querying
    `port` (default: the query port), with `flags` (True: a bare flag)."""
    argv = [f"{BIN}/kv-indexer-loadgen", "--endpoint", f"http://127.0.0.1:{port or args.port}",
            "--ingest-endpoint", f"http://127.0.0.1:{apply_port(args)}",
            "--workers", str(args.workers), "--prompts", str(args.prompts),
            "--prompt-blocks", str(args.prompt_blocks), "--timeout-ms", str(args.timeout_ms),
            "--ingest-batch", str(args.ingest_batch)]
    for flag, value in flags.items():
        argv.append(f"--{flag.replace('_', '-')}")
        if value is not True:
            argv.append(str(value))
    return pinned(1, argv)


def loadgen(args, ingest, out, **flags):
    """Starts one generator writing its JSON line to `out`: the churn of applies (`ingest`, a
    process of its own, like a bridge, so that it never queues behind the query generator's
    tasks; its trickle of queries goes to the apply port, so that it takes none of the query
    port's connections) or the queries (no churn). The prompts were preloaded once."""
    argv = generator(args, apply_port(args) if ingest else args.port, ingest_ops=args.ingest_ops if ingest else 0, json_out=out,
                     no_preload=True, **flags)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


def run_phase(args, server, name, duration, **query_flags):
    """Queries with `query_flags` for `duration` s while the churn runs (a little longer, so
    that it covers the whole query run): the query generator's JSON report with the churn's
    apply fields and the server's side (histogram bounds, CPU by thread role) added."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, "queries.jsonl"), os.path.join(tmp, "churn.jsonl")]
        churn = loadgen(args, True, outs[1], qps=1, concurrency=1, connections=1,
                        duration_secs=duration + 4, label="churn")
        time.sleep(1)  # the churn has started
        before, (cpu_before, busy_before) = histograms(args), cpu_times(server.pid)
        queries = loadgen(args, False, outs[0], duration_secs=duration,
                          label=f"{args.label}/{name}" if args.label else name, **query_flags)
        out, err = queries.communicate(timeout=600)
        if queries.returncode != 0:
            raise RuntimeError(f"loadgen failed: {out}\n{err}")
        after, (cpu_after, busy_after) = histograms(args), cpu_times(server.pid)
        out, err = churn.communicate(timeout=600)
        if churn.returncode != 0:
            raise RuntimeError(f"churn loadgen failed: {out}\n{err}")
        r, applies = (json.loads(open(path).read().splitlines()[-1]) for path in outs)
    for key, value in applies.items():
        if key.startswith("appl"):
            r[key] = value
    r["server_ms"] = {f"{rpc} {code}": {"n": n, "p50_le": p50, "p99_le": p99}
                      for (rpc, code), (n, p50, p99) in
                      (((k, server_percentiles(before, after, k)) for k in after)) if n}
    cpu = {role: cpu_after.get(role, 0.0) - cpu_before.get(role, 0.0) for role in cpu_after}
    r["server_cpu_s"] = {role: round(s, 2) for role, s in cpu.items() if s > 0}
    r["cpu0_busy_s"] = round(busy_after - busy_before, 2)
    # Both generators (on CPU 1), over their whole runs: near 100 % of the phase, the client
    # is the limit, not the server.
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    r["generators_cpu_s"] = round(done.ru_utime + done.ru_stime - children.ru_utime - children.ru_stime, 2)
    r["cpu0_others_s"] = round(max(0.0, r["cpu0_busy_s"] - sum(cpu.values())), 2)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=28600)
    ap.add_argument("--admission", type=int, default=4,
                    help="the server's --prefix-query-max-inflight (4: a few scans' wait on one core)")
    ap.add_argument("--query-threads", type=int, help="the server's --query-threads (default: its own)")
    ap.add_argument("--max-connections", type=int, help="the server's --max-connections (default: none)")
    ap.add_argument("--max-concurrent-streams", type=int, help="the server's --max-concurrent-streams")
    ap.add_argument("--server-bin", default=f"{BIN}/kv-indexer-server",
                    help="the server to drive (another build, to compare)")
    ap.add_argument("--duration-s", type=int, default=15, help="per phase")
    ap.add_argument("--factor", type=float, default=3.0, help="offered load in multiples of capacity")
    ap.add_argument("--overload-concurrency", type=int, default=192)
    ap.add_argument("--connections", type=int, default=48, help="the generator's, in phases 3 and 4")
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--prompt-blocks", type=int, default=1000)
    ap.add_argument("--ingest-ops", type=int, default=200_000, help="block-ops/s of churn")
    ap.add_argument("--ingest-batch", type=int, default=1024)
    ap.add_argument("--timeout-ms", type=int, default=1000, help="each query's grpc-timeout")
    ap.add_argument("--same-port", action="store_true",
                    help="send applies to the query port, not the server's apply listener")
    ap.add_argument("--label", default="", help="names the runs in the JSON lines")
    ap.add_argument("--json-out", help="append one JSON line per phase to this file")
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()

    build(args, "sgl-kv-indexer", "kv-indexer-tools")
    argv = [args.server_bin, "--listen-addr", f"127.0.0.1:{args.port}",
            "--apply-listen-addr", f"127.0.0.1:{args.port + 1}",
            "--metrics-addr", f"127.0.0.1:{args.port + 2}",
            "--prefix-query-max-inflight", str(args.admission),
            # The prompts are preloaded once: their workers must not expire between phases.
            "--worker-ttl-s", "0"]
    for flag in ("query_threads", "max_connections", "max_concurrent_streams"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    server = subprocess.Popen(pinned(0, argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        preload = subprocess.run(generator(args, apply_port(args), qps=1, concurrency=1, connections=1, duration_secs=1),
                                 capture_output=True, text=True, timeout=600)
        if preload.returncode != 0:
            raise RuntimeError(f"preloading failed: {preload.stdout}\n{preload.stderr}")
        d = args.duration_s
        phases = {}

        def phase(name, **flags):
            print(f"phase {len(phases) + 1}: {name} …", file=sys.stderr, flush=True)
            sampler.phase = name
            phases[name] = run_phase(args, server, name, d, **flags)

        # Phases 2 and 3 stay within the connections the server serves: they measure it, not
        # its refusals.
        served = min(args.connections, args.max_connections or args.connections)
        phase("applies", qps=1, concurrency=1, connections=1)
        phase("capacity", qps=0, concurrency=args.admission, connections=min(args.admission, served))
        capacity = phases["capacity"]["answered_per_s"]
        phase("unloaded", qps=max(1, int(capacity / 10)), concurrency=args.overload_concurrency,
              connections=served)
        phase("overload", qps=int(capacity * args.factor), concurrency=args.overload_concurrency,
              connections=args.connections)
        sampler.phase = "end"
        time.sleep(1)
        sampler.stop.set()
    finally:
        server.terminate()
        server.wait(timeout=10)

    for name, r in phases.items():
        rss = sampler.of(name)
        r["rss_mib"] = [round(min(rss, default=0)), round(max(rss, default=0))]
    report(args, phases)
    if args.json_out:
        with open(args.json_out, "a") as f:
            for r in phases.values():
                f.write(json.dumps(r) + "\n")
    failed = any(r.get("applies_refused_by_code") for r in phases.values())
    return 1 if failed else 0


def report(args, phases):
    print()
    print(f"server {args.server_bin}: --prefix-query-max-inflight {args.admission}"
          + "".join(f", --{f.replace('_', '-')} {getattr(args, f)}"
                    for f in ("query_threads", "max_connections", "max_concurrent_streams")
                    if getattr(args, f) is not None)
          + f"; applies to {'the query port' if args.same_port else 'the apply listener'}; "
          f"{args.prompts} prompts of {args.prompt_blocks} blocks held by {args.workers} workers; churn "
          f"{args.ingest_ops} block-ops/s in applies of {args.ingest_batch}; {args.duration_s} s a phase")
    print(f"{'phase':<9} {'offered/s':>9} {'answered/s':>10} {'ok p50/p99 ms':>14} {'failed/s':>8} "
          f"{'refused p50/p99 ms':>18} {'apply p50/p99 ms':>16} {'applies refused':>15} "
          f"{'others s':>8} {'rss MiB':>9}")
    ms = lambda r, name: f"{r[name + '_p50_us'] / 1000:.2f}/{r[name + '_p99_us'] / 1000:.2f}"
    for name, r in phases.items():
        print(f"{name:<9} {r['sent_per_s']:>9.0f} {r['answered_per_s']:>10.0f} {ms(r, 'answered'):>14} "
              f"{r['failed_per_s']:>8.0f} {ms(r, 'refused'):>18} {ms(r, 'apply'):>16} "
              f"{json.dumps(r.get('applies_refused_by_code', {})):>15} {r['cpu0_others_s']:>8.2f} "
              f"{r['rss_mib'][0]:>4}-{r['rss_mib'][1]:<4}")
        if r["failed_by_code"]:
            print(f"          failed at the client, by code: {r['failed_by_code']}")
        seen = ", ".join(f"{key} {v['n']} (p50 <= {v['p50_le']:g} ms, p99 <= {v['p99_le']:g} ms)"
                         for key, v in sorted(r["server_ms"].items()))
        print(f"          at the server, arrival to answer: {seen}")
        cpu = r["server_cpu_s"]
        calls = (r["sent_per_s"] * r["elapsed_s"]) or 1
        answers = r["answered"] or 1
        print(f"          server CPU s: {cpu}; runtime {1e6 * cpu.get('runtime', 0) / calls:.0f} µs a call, "
              f"query threads {1e6 * cpu.get('queries', 0) / answers:.0f} µs an answer; "
              f"CPU 0 busy {r['cpu0_busy_s']} s of {r['elapsed_s']:.1f}; generators {r['generators_cpu_s']} s")
    unloaded, over = phases["unloaded"], phases["overload"]
    ratio = over["answered_p99_us"] / max(1, unloaded["answered_p99_us"])
    print(f"admitted p99 at {args.factor:g}x: {over['answered_p99_us'] / 1000:.2f} ms, unloaded p99 "
          f"{unloaded['answered_p99_us'] / 1000:.2f} ms: {ratio:.2f}x (target <= 2x)")
    refused = any(r.get("applies_refused_by_code") for r in phases.values())
    print("applies refused: " + ("NONE" if not refused else
                                 str({n: r["applies_refused_by_code"] for n, r in phases.items()})))


if __name__ == "__main__":
    sys.exit(main())
