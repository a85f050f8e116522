#!/usr/bin/env python3
"""What the shared log costs, with real processes on loopback: a real redis-server, Indexer
replicas with `--event-log` (pinned to CPU 0, as in durable_bench.py), the load generator on
CPU 1.

1. ingest: apply throughput and latency (kv-indexer-loadgen's REPORT/REVOKE churn sent to the
   first replica) with 1, 2 and 3 replicas, next to one in-memory server; how many entries
   (applies) the other replicas are behind the first (GET /state positions, every 20 ms) while
   it runs; the stream's Redis memory per block-op held;
2. min-replicas: the ingest of one replica with a Redis replica attached, answering after the
   primary has an append or (KV_INDEXER_EVENT_LOG_MIN_REPLICAS 1) after the Redis replica too;
3. join: time for a new replica to be SERVING at P placements, (a) replaying the whole stream,
   (b) from the snapshot the first replica published (and the stream after it).

    scripts/fleet_bench.py [--only ingest,min-replicas,join] [--placements 1000000,10000000]

Needs redis-server (scripts/install_redis.sh); only the Python standard library otherwise.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import durable_bench as db  # noqa: E402  (Server, churn, preload_flags, the shared options)
import harness  # noqa: E402  (the scripts' shared helpers: build, redis_command)

KEY = "sgl-kv-indexer:events"
# Every process started, stopped by pid whatever happens (see main).
STARTED = []


def server(port, logs, extra):
    started = db.Server(port, logs, extra)
    STARTED.append(started.popen)
    return started


def redis_command(port, *args):
    """One command; MEMORY USAGE of a long stream may take a while."""
    return harness.redis_command(port, *args, timeout=600)


class Redis:
    def __init__(self, port, logs, primary=None):
        """A redis-server on `port`; a replica of the one on port `primary` when given."""
        self.port = port
        self.dir = tempfile.mkdtemp(prefix="kv-bench-redis-", dir=logs)
        follow = ["--replicaof", db.HOST, str(primary)] if primary else []
        self.popen = subprocess.Popen(["redis-server", "--bind", db.HOST, "--port", str(port), "--save", "",
                                       "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no", *follow],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        STARTED.append(self.popen)
        deadline = time.time() + 10
        while True:
            try:
                if redis_command(port, "PING") == "+PONG":
                    return
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    def url(self):
        return f"redis://{db.HOST}:{self.port}/0"

    def stop(self):
        self.popen.kill()
        self.popen.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def replicas(args, logs, redis, count, extra=()):
    out = []
    for k in range(count):
        out.append(server(args.base_port + 10 * k, logs, ["--event-log", redis.url(), *extra]))
    for replica in out:
        replica.wait_ready()
    return out


def lag_poller(leader, followers):
    """Samples, every 20 ms until the returned event is set, how many entries each follower is
    behind the leader (positions read one right after the other)."""
    samples, stop = [], threading.Event()

    def run():
        while not stop.is_set():
            for follower in followers:
                try:
                    ahead = leader.state()["position"]
                    samples.append(max(0, ahead - follower.state()["position"]))
                except Exception:
                    pass
            time.sleep(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return samples, stop, thread


def pct(values, q):
    if not values:
        return 0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def ingest(args, logs):
    print(f"\n## ingest: REPORT/REVOKE churn to the first replica (target {args.ingest_ops / 1e6:.1f} M "
          f"block-ops/s, {args.ingest_batch} hashes per apply, {args.ingest_secs} s)")
    print(f"{'setup':<22} {'achieved M/s':>12} {'apply p50 µs':>12} {'p99 µs':>8} {'max µs':>8} "
          f"{'behind p50':>10} {'behind p99':>10} {'Redis B/op':>10}")
    single = server(args.base_port, logs, [])
    single.wait_ready()
    achieved, p50, p99, top = db.churn(args, args.base_port)
    single.stop()
    print(f"{'one server, in memory':<22} {achieved:>12.2f} {p50:>12} {p99:>8} {top:>8} {'-':>10} {'-':>10} {'-':>10}")
    for count in (1, 2, 3):
        redis = Redis(args.base_port + 5, logs)
        servers = replicas(args, logs, redis, count, ["--snapshot-interval-s", "0"])
        samples, stop, thread = lag_poller(servers[0], servers[1:])
        achieved, p50, p99, top = db.churn(args, args.base_port)
        stop.set()
        thread.join()
        memory = int(redis_command(redis.port, "MEMORY", "USAGE", KEY, "SAMPLES", "0").lstrip(":") or 0)
        ops = achieved * 1e6 * args.ingest_secs
        lag = (f"{pct(samples, 0.5):>10} {pct(samples, 0.99):>10}" if samples else f"{'-':>10} {'-':>10}")
        print(f"{f'{count} replica(s)':<22} {achieved:>12.2f} {p50:>12} {p99:>8} {top:>8} {lag} "
              f"{memory / max(ops, 1):>10.1f}")
        for s in servers:
            s.stop(signal.SIGKILL)
        redis.stop()


def join_once(args, logs, redis, before, how):
    """Starts a new replica, times it to SERVING and prints the row."""
    entries = redis_command(redis.port, "XLEN", KEY).lstrip(":")
    new = server(args.base_port + 10, logs, ["--event-log", redis.url(), "--snapshot-interval-s", "0"])
    took = new.wait_ready()
    same = new.state()["digest"] == before["digest"]
    print(f"{before['placements']:>11} {how:<34} {took:>12.2f} {'equal' if same else 'DIFFERS':>7} {entries:>14}")
    new.stop(signal.SIGKILL)


def join(args, logs):
    print("\n## join: a new replica's time from its start to SERVING")
    print(f"{'placements':>11} {'from':<34} {'to SERVING s':>12} {'digest':>7} {'stream entries':>14}")
    for target in args.placements:
        redis = Redis(args.base_port + 5, logs)
        first = server(args.base_port, logs, ["--event-log", redis.url(), "--snapshot-interval-s", "0"])
        first.wait_ready()
        db.loadgen(args.base_port, *db.preload_flags(target))
        before = first.state()
        join_once(args, logs, redis, before, "the whole stream")
        first.stop(signal.SIGKILL)
        # (b) a replica that publishes a snapshot every second: wait for one, then join.
        first = server(args.base_port, logs, ["--event-log", redis.url(), "--snapshot-interval-s", "1"])
        first.wait_ready()
        deadline = time.time() + 600
        while "published=true" not in re.sub(r"\x1b\[[0-9;]*m", "", first.log_text()):
            if time.time() > deadline:
                raise RuntimeError("no snapshot was published")
            time.sleep(0.2)
        join_once(args, logs, redis, before, "the published snapshot + stream")
        first.stop(signal.SIGKILL)
        redis.stop()


def min_replicas(args, logs, runs=3):
    """Ingest into one replica with a Redis replica beside the primary, answering after the
    primary has an append (MIN_REPLICAS 0) or after the Redis replica has it too (1: WAIT 1);
    the two interleaved, `runs` times each."""
    print(f"\n## KV_INDEXER_EVENT_LOG_MIN_REPLICAS: the same churn, a Redis replica attached, {runs} interleaved runs")
    print(f"{'setup':<22} {'achieved M/s':>12} {'apply p50 µs':>12} {'p99 µs':>8} {'max µs':>8}")
    for run in range(runs):
        for wanted in (0, 1):
            redis = Redis(args.base_port + 5, logs)
            follower = Redis(args.base_port + 6, logs, primary=redis.port)
            deadline = time.time() + 10
            while redis_command(redis.port, "WAIT", "1", "100") != ":1":
                if time.time() > deadline:
                    raise RuntimeError("the Redis replica did not sync")
            servers = replicas(args, logs, redis, 1, ["--snapshot-interval-s", "0",
                                                      "--event-log-min-replicas", str(wanted)])
            achieved, p50, p99, top = db.churn(args, args.base_port)
            print(f"{f'MIN_REPLICAS {wanted}, run {run + 1}':<22} {achieved:>12.2f} {p50:>12} {p99:>8} {top:>8}")
            for s in servers:
                s.stop(signal.SIGKILL)
            follower.stop()
            redis.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="ingest,join")
    db.add_bench_args(ap, base_port=29100)
    args = db.parse_bench_args(ap)
    if not shutil.which("redis-server"):
        ap.error("redis-server is not installed: run scripts/install_redis.sh")
    harness.build(args, "sgl-kv-indexer", "kv-indexer-tools")
    logs = tempfile.mkdtemp(prefix="kv-fleet-bench-")
    print(f"machine: {os.cpu_count()} CPUs; replicas on CPU 0, the load generator on CPU 1, Redis unpinned; "
          f"logs {logs}")
    for part in args.only.split(","):
        {"ingest": ingest, "join": join, "min-replicas": min_replicas}[part](args, logs)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        for popen in STARTED:
            if popen.poll() is None:
                popen.kill()
                popen.wait()
