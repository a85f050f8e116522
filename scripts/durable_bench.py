#!/usr/bin/env python3
"""What durability costs, with real processes on loopback (server pinned to CPU 0, the load
generator to CPU 1 when the machine has two):

1. ingest: apply throughput and latency over gRPC (kv-indexer-loadgen's REPORT/REVOKE churn)
   in memory and with KV_INDEXER_LOG_SYNC off / batch / always;
2. start-up: preload P placements, then (a) kill -9 and restart (log replay), (b) SIGTERM
   (final snapshot) and restart (snapshot load), (c) a snapshot built in the background from
   the log, (d) one built from the snapshot and a little more log (as a running server builds
   them); time from the restart to SERVING, the snapshots' times and size, disk bytes per
   placement, resident and peak memory (a snapshot process's too: PSS of the server and its
   children, sampled every 0.05 s), and (e) snapshots every second
   under heavy churn: the memory beside the index and the writer's longest fork pause; --runs N repeats it, --server NAME=PATH (repeatable)
   compares builds, interleaved;
3. snapshot stalls: the longest apply and query latency while snapshots run every second,
   next to the same run without snapshots;
4. growth (not in the default --only): prefix queries while a preload grows an in-memory index
   to each --placements target, and the block table rebuilds the server logged.

    scripts/durable_bench.py [--placements 1000000,10000000] [--only ingest,startup,stall,growth]

Only the Python standard library; binaries from target/release (built unless --no-build).
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, HOST, build  # noqa: E402  (the scripts' shared helpers)
from overload import pinned  # noqa: E402  (taskset when there are two CPUs)


# The server's CPUs (--server-cpus): one core by default, the load generator on the other.
SERVER_CPUS = "0"


class Server:
    def __init__(self, port, logs, extra, binary=None):
        self.port, self.admin = port, f"{HOST}:{port + 1}"
        self.log_path = os.path.join(logs, f"server-{port}-{int(time.time() * 1000)}.log")
        self.log = open(self.log_path, "w")
        self.started = time.time()
        self.popen = subprocess.Popen(
            pinned(SERVER_CPUS, [binary or f"{BIN}/kv-indexer-server", "--listen-addr", f"{HOST}:{port}",
                       "--metrics-addr", self.admin, "--worker-ttl-s", "0", *extra]),
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)

    def state(self):
        with urllib.request.urlopen(f"http://{self.admin}/state", timeout=120) as r:
            return json.loads(r.read())

    def serving(self):
        """Whether the server reports SERVING: its `kv_indexer_serving` gauge (cheap, unlike
        /state, which computes the digest)."""
        with urllib.request.urlopen(f"http://{self.admin}/metrics", timeout=10) as r:
            return re.search(rb"^kv_indexer_serving 1$", r.read(), re.M) is not None

    def wait_ready(self, timeout=600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if self.serving():
                    return time.time() - self.started
            except Exception:
                pass
            if self.popen.poll() is not None:
                raise RuntimeError(f"the server exited; see {self.log_path}")
            time.sleep(0.005)
        raise RuntimeError("the server never became ready")

    def stop(self, sig=signal.SIGTERM):
        self.popen.send_signal(sig)
        self.popen.wait(timeout=600)
        self.log.close()

    def log_text(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()


def loadgen(port, *flags):
    out = subprocess.run(pinned(1, [f"{BIN}/kv-indexer-loadgen", "--endpoint", f"http://{HOST}:{port}",
                                    *map(str, flags)]), capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"loadgen failed: {out.stdout} {out.stderr}")
    return out.stdout


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))


def churn(args, port):
    """The load generator's REPORT/REVOKE churn at --ingest-ops against `port`: the achieved M
    block-ops/s and the apply latency's p50, p99 and max in µs."""
    out = loadgen(port, "--workers", 16, "--prompts", 16, "--prompt-blocks", 64, "--qps", 1,
                  "--concurrency", 1, "--duration-secs", args.ingest_secs, "--ingest-ops", args.ingest_ops,
                  "--ingest-batch", args.ingest_batch)
    achieved = float(re.search(r"ingest: ([\d.]+) M block-ops/s", out).group(1))
    lat = re.search(r"apply \(REPORT or REVOKE\) latency µs over \d+: p50 (\d+) p99 (\d+) max (\d+)", out)
    return achieved, lat.group(1), lat.group(2), lat.group(3)


def ingest(args, logs):
    print("\n## ingest: REPORT/REVOKE churn over gRPC (target "
          f"{args.ingest_ops / 1e6:.1f} M block-ops/s, {args.ingest_batch} hashes per apply)")
    print(f"{'mode':<14} {'achieved M/s':>12} {'apply p50 µs':>12} {'p99 µs':>8} {'max µs':>8}")
    for mode in ["memory", "off", "batch", "always"]:
        state = tempfile.mkdtemp(prefix="kv-bench-state-", dir=args.state_root)
        extra = [] if mode == "memory" else ["--state-dir", state, "--log-sync", mode, "--snapshot-interval-s", "0"]
        server = Server(args.base_port, logs, extra)
        server.wait_ready()
        achieved, p50, p99, top = churn(args, args.base_port)
        server.stop()
        print(f"{mode:<14} {achieved:>12.2f} {p50:>12} {p99:>8} {top:>8}")
        shutil.rmtree(state, ignore_errors=True)


def preload_flags(placements):
    # loadgen reports each prompt whole for one worker and cut at random for two more:
    # about 2 x prompts x blocks placements.
    blocks = 4096
    prompts = max(1, placements // (2 * blocks))
    return ["--workers", 256, "--prompts", prompts, "--prompt-blocks", blocks, "--qps", 1,
            "--concurrency", 1, "--duration-secs", 0]


def memory_mb(pid):
    """(resident MB now, peak resident MB so far) of process `pid`."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def tree_pss_mb(pid):
    """Proportional set size, MB, of process `pid` and its children. A snapshot written by a
    forked child shares the server's pages copy-on-write; PSS counts each page once over both,
    so the sum is the memory the two hold together."""
    pids = [pid]
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                pids += [int(child) for child in f.read().split()]
        except OSError:
            pass
    kb = 0
    for one in pids:
        try:
            with open(f"/proc/{one}/smaps_rollup") as f:
                kb += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except OSError:
            pass  # the child has just exited
    return kb / 1024


class PeakSampler:
    """The highest tree_pss_mb(pid) seen, sampled every `every` s on a thread until stop()."""

    def __init__(self, pid, every=0.05):
        self.pid, self.every, self.peak = pid, every, 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, tree_pss_mb(self.pid))
            self.done.wait(self.every)

    def stop(self):
        self.done.set()
        self.thread.join()
        return self.peak


def build_peak_mb(pid, sampler):
    """Peak memory while a snapshot was built: the sampled peak PSS of the server and its
    snapshot process together (not the server's VmHWM, which also holds its start's peak)."""
    return sampler.stop()


def median_range(values, fmt="{:.2f}"):
    """'median (min-max)' of `values`, or the one value."""
    values = sorted(values)
    mid = fmt.format(values[len(values) // 2])
    return mid if len(values) == 1 else f"{mid} ({fmt.format(values[0])}-{fmt.format(values[-1])})"


def wait_for_log(server, pattern, timeout=900):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(pattern, server.log_text())
        if m:
            return m
        time.sleep(0.05)
    raise RuntimeError(f"no {pattern!r} in {server.log_path}")


def startup_once(args, logs, seed, binary, before):
    """One build's start-up figures on a copy of the preloaded state directory `seed` (log only):
    the log replayed after kill -9, a snapshot built in the background from that log, the
    final snapshot at SIGTERM and the start from it. Returns a dict of figures."""
    out = {}
    state = tempfile.mkdtemp(prefix="kv-bench-state-", dir=args.state_root)
    shutil.rmtree(state)
    shutil.copytree(seed, state)
    extra = ["--state-dir", state, "--snapshot-interval-s", "0"]
    replayed = Server(args.base_port, logs, extra, binary)
    out["replay_s"] = replayed.wait_ready()
    out["replay_equal"] = replayed.state()["digest"] == before["digest"]
    out["replay_rss"], out["replay_peak"] = memory_mb(replayed.popen.pid)
    t0 = time.time()
    replayed.stop(signal.SIGTERM)
    took = time.time() - t0
    m = re.search(r"snapshot written.*?took_ms=(\d+)", replayed.log_text())
    out["final_snapshot_s"] = int(m.group(1)) / 1000 if m else took
    snap = [f for f in os.listdir(state) if f.endswith(".snap")]
    out["snapshot_mb"] = sum(os.path.getsize(os.path.join(state, f)) for f in snap) / 1e6
    out["disk_b"] = dir_bytes(state) / before["placements"]
    loaded = Server(args.base_port, logs, extra, binary)
    out["load_s"] = loaded.wait_ready()
    out["load_rss"], out["load_peak"] = memory_mb(loaded.popen.pid)
    out["load_equal"] = loaded.state()["digest"] == before["digest"]
    loaded.stop(signal.SIGKILL)
    # A snapshot built as a running server builds them: from the previous snapshot and the log
    # since (a few seconds of churn here).
    steady = Server(args.base_port, logs, ["--state-dir", state, "--snapshot-interval-s", "3"], binary)
    steady.wait_ready()
    out["steady_rss"] = memory_mb(steady.popen.pid)[0]
    sampler = PeakSampler(steady.popen.pid)
    loadgen(args.base_port, "--workers", 16, "--prompts", 16, "--prompt-blocks", 64, "--qps", 1,
            "--concurrency", 1, "--duration-secs", 2, "--ingest-ops", 200000)
    m = wait_for_log(steady, r"snapshot written.*?took_ms=(\d+)")
    out["steady_build_s"] = int(m.group(1)) / 1000
    out["steady_peak"] = build_peak_mb(steady.popen.pid, sampler)
    steady.stop(signal.SIGKILL)
    # Snapshots every second under heavy churn (200k block-ops/s for --churn-secs): the
    # memory they hold beside the index (a forked child's copied pages) and the writer's
    # longest pause for a fork.
    churned = Server(args.base_port, logs, ["--state-dir", state, "--snapshot-interval-s", "1"], binary)
    churned.wait_ready()
    out["churn_rss"] = memory_mb(churned.popen.pid)[0]
    # Not more often: reading smaps_rollup holds the memory map's lock, which a fork waits for.
    sampler = PeakSampler(churned.popen.pid)
    loadgen(args.base_port, "--workers", 16, "--prompts", 16, "--prompt-blocks", 64, "--qps", 1,
            "--concurrency", 1, "--duration-secs", args.churn_secs, "--ingest-ops", 200000)
    wait_for_log(churned, r"snapshot written.*?took_ms=(\d+)")
    out["churn_peak"] = build_peak_mb(churned.popen.pid, sampler)
    pauses = [int(us) for us in re.findall(r"snapshot written.*?fork_us=(\d+)", churned.log_text())]
    out["fork_ms"] = max(pauses, default=0) / 1000
    churned.stop(signal.SIGKILL)
    shutil.rmtree(state, ignore_errors=True)
    # A snapshot built in the background from the whole log (a server that has run for a
    # while): its time and the server's peak memory meanwhile.
    shutil.copytree(seed, state)
    building = Server(args.base_port, logs, ["--state-dir", state, "--snapshot-interval-s", "1"], binary)
    building.wait_ready()
    rss, _ = memory_mb(building.popen.pid)
    sampler = PeakSampler(building.popen.pid)
    m = wait_for_log(building, r"snapshot written.*?took_ms=(\d+)")
    out["build_s"] = int(m.group(1)) / 1000
    out["build_rss"], out["build_peak"] = rss, build_peak_mb(building.popen.pid, sampler)
    building.stop(signal.SIGKILL)
    shutil.rmtree(state, ignore_errors=True)
    return out


def startup(args, logs):
    """Per placement target and run: one preload (the log format is every build's), then each
    build in turn (rotated per run) on its own copy of it."""
    print("\n## start-up: time from the process start to SERVING, median (range) over "
          f"{args.runs} run(s); builds: {', '.join(name for name, _ in args.servers)}")
    for target in args.placements:
        figures = {name: [] for name, _ in args.servers}
        placements, grow = 0, []
        for run in range(args.runs):
            seed = tempfile.mkdtemp(prefix="kv-bench-seed-", dir=args.state_root)
            server = Server(args.base_port, logs, ["--state-dir", seed, "--snapshot-interval-s", "0"],
                            args.servers[0][1])
            server.wait_ready()
            loadgen(args.base_port, *preload_flags(target))
            before = server.state()
            placements = before["placements"]
            grow.append(memory_mb(server.popen.pid))
            server.stop(signal.SIGKILL)
            order = args.servers[run % len(args.servers):] + args.servers[:run % len(args.servers)]
            for name, binary in order:
                figures[name].append(startup_once(args, logs, seed, binary, before))
            shutil.rmtree(seed, ignore_errors=True)
        print(f"\n{placements} placements; while the table grows (preload): resident "
              f"{median_range([g[0] for g in grow], '{:.0f}')} MB, peak {median_range([g[1] for g in grow], '{:.0f}')} MB")
        rows = [("kill -9: log replay, s", "replay_s", "{:.2f}"), ("SIGTERM: snapshot load, s", "load_s", "{:.2f}"),
                ("final snapshot written, s", "final_snapshot_s", "{:.2f}"),
                ("background snapshot built, s", "build_s", "{:.2f}"), ("snapshot MB", "snapshot_mb", "{:.0f}"),
                ("disk B/placement", "disk_b", "{:.1f}"), ("resident after load, MB", "load_rss", "{:.0f}"),
                ("peak during load, MB", "load_peak", "{:.0f}"), ("peak during replay, MB", "replay_peak", "{:.0f}"),
                ("resident before a build, MB", "build_rss", "{:.0f}"),
                ("peak while a snapshot is built, MB", "build_peak", "{:.0f}"),
                ("snapshot + 2 s of log built, s", "steady_build_s", "{:.2f}"),
                ("resident before it, MB", "steady_rss", "{:.0f}"),
                ("peak while it is built, MB", "steady_peak", "{:.0f}"),
                ("snapshots under churn: resident, MB", "churn_rss", "{:.0f}"),
                ("peak under churn, MB", "churn_peak", "{:.0f}"),
                ("longest fork pause, ms", "fork_ms", "{:.1f}")]
        print(f"{'':<36}" + "".join(f"{name:>26}" for name in figures))
        for label, key, fmt in rows:
            print(f"{label:<36}" + "".join(f"{median_range([r[key] for r in runs], fmt):>26}"
                                           for runs in figures.values()))
        print(f"{'digest equal after both starts':<36}" + "".join(
            f"{str(all(r['replay_equal'] and r['load_equal'] for r in runs)):>26}" for runs in figures.values()))


def stall_once(args, logs, binary, every):
    """Queries and applies against `binary` preloaded with --stall-placements, snapshots every
    `every` s (0: none): (query p99, query max, apply p99, apply max) in µs, snapshots written."""
    state = tempfile.mkdtemp(prefix="kv-bench-state-", dir=args.state_root)
    server = Server(args.base_port, logs, ["--state-dir", state, "--snapshot-interval-s", str(every),
                                           "--log-sync", args.stall_log_sync], binary)
    server.wait_ready()
    loadgen(args.base_port, *preload_flags(args.stall_placements))
    out = loadgen(args.base_port, "--workers", 256, "--prompts", 64, "--prompt-blocks", 1024, "--qps", 2000,
                  "--concurrency", 8, "--duration-secs", args.stall_secs, "--ingest-ops", 200000,
                  "--ingest-batch", 4096)
    server.stop()
    q = re.search(r"OK: +\d+ .*?p99 (\d+) p999 \d+ max (\d+)", out)
    a = re.search(r"apply \(REPORT or REVOKE\) latency µs over \d+: p50 \d+ p99 (\d+) max (\d+)", out)
    shutil.rmtree(state, ignore_errors=True)
    return [int(q.group(1)), int(q.group(2)), int(a.group(1)), int(a.group(2))], \
        server.log_text().count("snapshot written")


def stall(args, logs):
    """Per run, each build without snapshots and with one every second (rotated per run)."""
    print("\n## snapshot stalls: queries and applies while snapshots run every second, "
          f"{args.stall_placements} placements preloaded; median (range) over {args.runs} run(s)")
    results = {}
    for run in range(args.runs):
        cases = [(name, binary, every) for name, binary in args.servers for every in (0, 1)]
        for name, binary, every in cases[run % len(cases):] + cases[:run % len(cases)]:
            figures, count = stall_once(args, logs, binary, every)
            results.setdefault((name, every), []).append(figures + [count])
    print(f"{'build':<10} {'snapshots':<10} {'query p99 µs':>22} {'query max µs':>22} {'apply p99 µs':>22} "
          f"{'apply max µs':>22} {'written':>9}")
    for (name, every), runs in results.items():
        cells = [median_range([r[i] for r in runs], "{:.0f}") for i in range(4)]
        print(f"{name:<10} {('every 1 s' if every else 'none'):<10} " + " ".join(f"{c:>22}" for c in cells)
              + f" {median_range([r[4] for r in runs], '{:.0f}'):>9}")


def growth_once(args, logs, binary, target):
    """One in-memory server preloaded to `target` placements while a client sends prefix
    queries: the preload's time, the queries' outcomes, and the table rebuilds the server logged."""
    os.environ["RUST_LOG"] = "info,kv_state::observe=debug"
    try:
        server = Server(args.base_port, logs, [], binary)
    finally:
        del os.environ["RUST_LOG"]
    server.wait_ready()
    out = {}

    def queries():
        out["queries"] = loadgen(args.base_port, "--workers", 256, "--prompts", 64, "--prompt-blocks", 64,
                                 "--qps", 500, "--concurrency", 4, "--duration-secs", args.growth_secs)
    client = threading.Thread(target=queries)
    client.start()
    started = time.time()
    loadgen(args.base_port, *preload_flags(target))
    preload = time.time() - started
    client.join()
    server.stop()
    outcomes = dict(re.findall(r"^ +(\w+): +(\d+) ", out["queries"], re.M))
    ok = re.search(r"OK: +\d+ .*?p99 (\d+) p999 \d+ max (\d+)", out["queries"])
    rebuilds = [(int(e), int(t)) for e, t in
                re.findall(r"rebuilt beside queries entries=(\d+) took_ms=(\d+)", server.log_text())]
    return preload, outcomes, int(ok.group(1)), int(ok.group(2)), rebuilds


def growth(args, logs):
    """Per target and run, each build (interleaved): queries while a preload grows the index."""
    print("\n## growth: prefix queries (500/s, 4 in flight, the client's 100 ms deadline) for "
          f"{args.growth_secs} s while a preload grows an in-memory index; one line per run")
    for target in args.placements:
        for run in range(args.runs):
            for name, binary in args.servers[run % len(args.servers):] + args.servers[:run % len(args.servers)]:
                preload, outcomes, p99, top, rebuilds = growth_once(args, logs, binary, target)
                failed = {code: n for code, n in outcomes.items() if code != "OK"}
                slow = ", ".join(f"{e / 1e6:.1f} M entries {t} ms" for e, t in rebuilds if t >= 100)
                print(f"{name:<10} {target:>11} placements: preload {preload:5.1f} s; queries OK "
                      f"{outcomes.get('OK', 0)}, failed {sum(map(int, failed.values()))} {failed or ''}; "
                      f"OK p99 {p99} µs, max {top} µs; table rebuilds of 100 ms or more: {slow or 'none logged'}",
                      flush=True)


def add_bench_args(ap, base_port):
    """The options this script and fleet_bench.py share: the placements, the ports from
    `base_port`, the churn and --no-build. Default bases lie below the kernel's ephemeral range,
    as the suites' do (`harness.Ports`): at 49100 a replica's connection to Redis took a port
    the next server was to listen on (2026-12-07)."""
    ap.add_argument("--placements", default="1000000,10000000")
    ap.add_argument("--base-port", type=int, default=base_port)
    ap.add_argument("--ingest-ops", type=int, default=3_000_000)
    ap.add_argument("--ingest-batch", type=int, default=4096)
    ap.add_argument("--ingest-secs", type=int, default=8)
    ap.add_argument("--no-build", action="store_true", help="use the binaries in target/release as they are")


def parse_bench_args(ap):
    """The command line, --placements as a list of numbers."""
    args = ap.parse_args()
    args.placements = [int(p) for p in args.placements.split(",") if p]
    return args


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="ingest,startup,stall")
    add_bench_args(ap, base_port=28800)
    ap.add_argument("--stall-placements", type=int, default=2_000_000)
    ap.add_argument("--stall-secs", type=int, default=10)
    ap.add_argument("--stall-log-sync", default="batch", help="the stall runs' --log-sync")
    ap.add_argument("--growth-secs", type=int, default=45,
                    help="how long the growth part's client queries (longer than the preload)")
    ap.add_argument("--state-root", default=None, help="where state directories go (default: the temp dir)")
    ap.add_argument("--churn-secs", type=int, default=6,
                    help="seconds of 200k block-ops/s churn with a snapshot every second (start-up part)")
    ap.add_argument("--runs", type=int, default=1, help="start-up runs per placement target (builds interleaved)")
    ap.add_argument("--server", action="append", default=[], metavar="NAME=PATH",
                    help="a server build to measure start-up with (repeatable; default: ours in target/release)")
    ap.add_argument("--server-cpus", default="0",
                    help="the server's CPUs (taskset list; the load generator stays on CPU 1)")
    args = parse_bench_args(ap)
    global SERVER_CPUS
    SERVER_CPUS = args.server_cpus
    args.servers = [tuple(s.split("=", 1)) for s in args.server] or [("ours", f"{BIN}/kv-indexer-server")]
    build(args, "sgl-kv-indexer", "kv-indexer-tools")
    logs = tempfile.mkdtemp(prefix="kv-durable-bench-")
    print(f"machine: {os.cpu_count()} CPUs; server on CPU 0, load generator on CPU 1; logs {logs}")
    for part in args.only.split(","):
        {"ingest": ingest, "startup": startup, "stall": stall, "growth": growth}[part](args, logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
