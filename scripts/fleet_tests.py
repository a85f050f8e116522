#!/usr/bin/env python3
"""Fault tests of a fleet of Indexer replicas on a shared Redis stream, with real processes on
loopback: after each fault, do all replicas hold the same index, and does it claim nothing a
worker does not hold? And what did the router see while it happened?

Fleet (harness.py's): a real `redis-server` (append-only file on), --replicas Indexer
replicas with `--event-log` (the last one reaches Redis through a proxy this script runs, so
that it can be cut off alone) and a state directory each, --workers simulated SGLang workers,
one bridge per worker listing every replica, and kv-indexer-router listing every replica.

Per case:
1. traffic to the workers until the index equals every worker's /cache_view;
2. the routing window: requests through the router (4 at a time) while the fault happens,
   from 1 s before it until 1 s after every replica serves again; the router's decisions by
   reason (hit ratio = cache_hit and predicted_hit / routed; blind = the Indexer gave no signal);
3. quiet; then every replica's digest (GET /state) must be equal, and the index against every
   worker's view: over-claimed must be 0 (under-claims are allowed only after FLUSHALL, where
   the log itself was lost).

Cases: none (control); kill9 (kill -9 the first replica, the one routers and bridges try
first, and restart it); roll (SIGTERM and restart every replica in turn, each serving before
the next); add (a new replica joins while applies flow: time until it serves); redis-restart
(Redis stopped and started again; AOF keeps the stream); flushall (Redis loses everything:
replicas must start over, never keep what the log no longer explains); partition (the last
replica cut off from Redis for longer than KV_INDEXER_MAX_LAG_MS: it must stop answering
queries, then catch up); rollback (Redis killed and started from an RDB saved 2 s earlier, as a
failover to a lagging replica or a restore from backup does: the replicas must clear what the
lost entries changed, and report how long until no replica over-claims); sentinel-0 and
sentinel-1 (the replicas on redis+sentinel:// with a Redis replica and three sentinels; the
primary killed under load, with KV_INDEXER_EVENT_LOG_MIN_REPLICAS 0 and 1, and one Redis replica
more than that: no over-claim, and with 1 no under-claim either).

    scripts/fleet_tests.py [--only kill9,roll] [--replicas 2] [--base-port 27900]
    scripts/fleet_tests.py --short --no-build --bin-dir target/debug   # CI: 5 cases, ~2 min

Exit status 1 when a case over-claims, ends with digests that differ, or fails; exit status 2
when redis-server is missing (in CI too: never a skip). Needs redis-server
(scripts/install_redis.sh); only the Python standard library otherwise (the plumbing is
harness.py). The binaries come from --bin-dir (default target/release, under
$CARGO_TARGET_DIR when set), built there with cargo unless --no-build.
"""

import argparse
import os
import signal
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402  (processes, Redis, the fleet, traffic, settle, the router)

CASES = {
    "none": "no fault (control)",
    "kill9": "kill -9 the first replica, restart",
    "roll": "SIGTERM + restart every replica in turn",
    "add": "a new replica joins while applies flow",
    "redis-restart": "Redis stopped and restarted (AOF)",
    "flushall": "FLUSHALL: Redis loses the log",
    "partition": "the last replica cut off from Redis",
    "rollback": "Redis back from an older save (RDB)",
    "sentinel-0": "Sentinel failover under load, MIN_REPLICAS 0",
    "sentinel-1": "Sentinel failover under load, MIN_REPLICAS 1",
}
# --short (CI): a replica killed and one cut off, Redis restarted, rolled back and failed
# over, with less traffic.
SHORT = ["kill9", "partition", "redis-restart", "rollback", "sentinel-1"]
SHORT_DEFAULTS = dict(before=15)
BINARIES = ["kv-indexer-server", "kv-indexer-sim", "kv-indexer-bridge", "kv-indexer-ctl", "kv-indexer-router"]
MAX_LAG_MS = 1000


class ReplicaFleet(h.ReplicaViews):
    def __init__(self, args, logs, min_replicas=None):
        """With `min_replicas`, the replicas find Redis through three sentinels watching it
        and a Redis replica of it, and wait for that many Redis replicas per append."""
        self.args, self.logs = args, logs
        self.min_replicas = min_replicas
        self.ports = ports = h.Ports(args.base_port)
        self.redis_port, self.redis_dir = ports("redis"), os.path.join(logs, "redis")
        self.redis = h.start_redis(logs, "redis", self.redis_port, appendonly=True, data_dir=self.redis_dir)
        if min_replicas is not None:
            self.start_sentinels()
        self.proxy = h.Proxy(ports("proxy"), self.redis_port)
        self.replicas = args.replicas

        def extra(k):
            port = self.redis_port if k < args.replicas - 1 or args.replicas == 1 else ports("proxy")
            return self.replica_flags(k, port)

        self.fleet = h.Fleet(args, logs, replicas=args.replicas, replica_extra=extra, ports=ports)
        self.wait_all_fresh()
        _, self.router_url = h.start_router(logs, ports, self.fleet.urls, self.fleet.endpoints)

    def start_sentinels(self):
        """Redis replicas of the primary (one more than MIN_REPLICAS asks for, so that writes
        go on when one of them is promoted), and three sentinels (quorum 2, down after 1 s)."""
        for r in range(self.min_replicas + 1):
            h.start_redis(self.logs, f"redis-replica-{r}", self.ports("redis-replica", r), replicaof=self.redis_port)
        wanted = str(self.min_replicas + 1)
        h.wait_until(lambda: h.redis_command(self.redis_port, "WAIT", wanted, "100") == f":{wanted}",
                     "the Redis replicas' sync")
        self.sentinel_ports = [self.ports("sentinel", i) for i in range(3)]
        h.start_sentinels(self.logs, self.sentinel_ports, self.redis_port)

    def replica_flags(self, k, redis_port):
        if self.min_replicas is None:
            log = [f"redis://{h.HOST}:{redis_port}/0"]
        else:
            hosts = ",".join(f"{h.HOST}:{port}" for port in self.sentinel_ports)
            log = [f"redis+sentinel://{hosts}/mymaster/0", "--event-log-min-replicas", str(self.min_replicas)]
        return ["--event-log", *log, "--metrics-addr", self.ports.addr("admin", k),
                "--state-dir", os.path.join(self.logs, f"state-{k}"), "--snapshot-interval-s", "2",
                "--max-lag-ms", str(MAX_LAG_MS)]

    def state(self, k):
        return h.admin_state(self.ports.addr("admin", k))

    def restart(self, k, sig):
        self.fleet.servers[k].restart(sig, self.args.down_s if sig == signal.SIGKILL else 0.0)
        return self.wait_fresh(k)

    def serving_again(self):
        """Seconds until every replica serves again."""
        start = time.time()
        self.wait_all_fresh()
        return time.time() - start


def time_to_no_over_claims(fleet, traffic, paused):
    """Seconds until no replica over-claims. Traffic pauses while they are counted: with it,
    events in flight always show some (a block evicted, its removal not yet applied)."""
    served = time.time()
    paused.set()
    try:
        replicas = fleet.fleet
        h.wait_until(lambda: all(replicas.over_claimed(traffic, e) == 0 for e in replicas.endpoints),
                     "no replica over-claims", timeout=30, interval=0.05)
    finally:
        paused.clear()
    return time.time() - served


def fault(name, fleet, traffic, paused):
    """Runs the fault; returns notes for the table."""
    notes = {}
    started = time.time()
    if name == "kill9":
        notes["to_serving_s"] = fleet.restart(0, signal.SIGKILL)
    elif name == "roll":
        notes["to_serving_s"] = max(fleet.restart(k, signal.SIGTERM) for k in range(fleet.replicas))
    elif name == "add":
        k = fleet.replicas
        fleet.fleet.servers.append(fleet.fleet.start_server(k, fleet.replica_flags(k, fleet.redis_port)))
        fleet.replicas += 1
        fleet.wait_fresh(k)
        notes["to_serving_s"] = time.time() - started
    elif name == "redis-restart":
        fleet.redis.restart(signal.SIGTERM, fleet.args.down_s)
        h.wait_redis(fleet.redis_port, "redis-server again")
        notes["to_serving_s"] = fleet.serving_again()
    elif name == "flushall":
        h.redis_command(fleet.redis_port, "FLUSHALL")
        time.sleep(2.0)
        notes["to_serving_s"] = fleet.serving_again()
    elif name == "rollback":
        # What a failover to a lagging Redis replica or a restore from backup does: Redis
        # comes back holding less than it acknowledged (the RDB of 2 s ago, its AOF gone).
        h.redis_command(fleet.redis_port, "SAVE")
        time.sleep(2.0)
        fleet.redis.kill9()
        shutil.rmtree(os.path.join(fleet.redis_dir, "appendonlydir"), ignore_errors=True)
        fleet.redis = h.start_redis(fleet.logs, "redis-older", fleet.redis_port, data_dir=fleet.redis_dir)
        notes["to_serving_s"] = fleet.serving_again()
        notes["over_zero_s"] = time_to_no_over_claims(fleet, traffic, paused)
    elif name.startswith("sentinel-"):
        # The primary dies under load; the sentinels promote a replica, the replicas follow;
        # the old primary comes back and the sentinels make it a replica of the new one.
        fleet.redis.kill9()
        h.wait_until(lambda: h.sentinel_master_port(fleet.sentinel_ports[0]) != fleet.redis_port,
                     "the sentinels' failover", timeout=30, interval=0.05)
        notes["failover_s"] = time.time() - started
        fleet.redis.start()
        notes["to_serving_s"] = fleet.serving_again()
        notes["over_zero_s"] = time_to_no_over_claims(fleet, traffic, paused)
    elif name == "partition":
        k = fleet.replicas - 1
        fleet.proxy.flowing.clear()
        cut = time.time()
        h.wait_until(lambda: not fleet.fresh(k), "the cut-off replica to stop answering", timeout=10, interval=0.01)
        notes["stale_after_s"] = time.time() - cut
        time.sleep(max(0.0, 2.5 - (time.time() - cut)))
        fleet.proxy.flowing.set()
        notes["to_serving_s"] = fleet.wait_fresh(k)
    return notes


def run_case(args, name, logs_root, seed):
    if name == "rollback" or name.startswith("sentinel-"):
        # Small caches, so that the workers drop blocks: what a lost log still claims for them
        # is an over-claim.
        args = argparse.Namespace(**{**vars(args), "capacity_tokens": 8192, "host_capacity_tokens": 8192})
    logs = os.path.join(logs_root, name)
    os.makedirs(logs)
    traffic = h.Traffic(args, seed)
    try:
        fleet = ReplicaFleet(args, logs, int(name[-1]) if name.startswith("sentinel-") else None)
        traffic.burst(fleet.fleet.urls, args.before)
        h.settle_exactly(fleet.fleet, traffic, args)
        fleet.wait_converged()
        # The routing window: 4 senders through the router from 1 s before the fault until 1 s
        # after it.
        notes, window, decisions, _ = h.routing_window(fleet.router_url, traffic,
                                                       lambda load: fault(name, fleet, traffic, load.paused))
        routed = sum(decisions.values())
        hits = h.hit_decisions(decisions)
        blind = sum(h.blind_decisions(decisions).values())
        # Quiet: every replica equal, and the index against the workers.
        fleet.wait_all_fresh()
        settled = h.settle(fleet.fleet, traffic, time.time(), args)
        try:
            fleet.wait_converged()
            converged = True
        except RuntimeError:
            converged = False
        digests = fleet.digests()
        return dict(routed=routed, hit_ratio=hits / max(routed, 1), blind=blind, window_s=window,
                    expected=settled["expected"], over=settled["over"], under=settled["under"],
                    digests_equal=converged and len(set(digests)) == 1, digests=digests, replicas=len(digests),
                    decisions=decisions, **notes)
    finally:
        h.stop_all()  # the processes and the proxy


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(CASES), help="comma-separated cases: " + ", ".join(CASES))
    ap.add_argument("--replicas", type=int, default=2)
    h.add_fleet_args(ap, workers=2, base_port=27900, docs=24, capacity_tokens=1 << 20,
                     host_capacity_tokens=1 << 20, stable_s=3.0, deadline_s=40.0, poll_s=0.2, seed=13)
    ap.add_argument("--before", type=int, default=40)
    ap.add_argument("--after", type=int, default=0)
    args = h.parse_args(ap, SHORT, **SHORT_DEFAULTS)
    cases = h.selected(ap, args.only, CASES)
    h.require_redis(ap)
    h.build(args, "sgl-kv-indexer", "kv-indexer-tools", "kv-indexer-router", binaries=BINARIES)
    logs_root = tempfile.mkdtemp(prefix="kv-fleet-tests-")
    rows, failed = h.run_cases(cases, CASES.get, lambda name, k: run_case(args, name, logs_root, args.seed + k))
    for name, r in rows:
        if r is None:
            continue
        # Under-claims are allowed where the log itself lost changes.
        failed |= bool(r["over"]) or not r["digests_equal"] or (
            r["under"] and name not in ("flushall", "rollback", "sentinel-0"))
        print(f"  {name}: decisions in the window: {r['decisions']}; digests "
              f"{sorted(set(d[:12] for d in r['digests']))}", file=sys.stderr)
    print()
    print(f"{'case':<14} {'description':<40} {'replicas':>8} {'placements':>10} {'over':>5} {'under':>6} "
          f"{'digests':>7} {'routed':>6} {'hit':>5} {'blind':>5} {'window_s':>8} {'serving_s':>9}")
    for name, r in rows:
        if r is None:
            print(f"{name:<14} {CASES[name]:<40} {'ERROR':>8}")
            continue
        digests = "equal" if r["digests_equal"] else "DIFFER"
        serving = f"{r['to_serving_s']:.2f}" if "to_serving_s" in r else "-"
        print(f"{name:<14} {CASES[name]:<40} {r['replicas']:>8} {r['expected']:>10} {r['over']:>5} {r['under']:>6} "
              f"{digests:>7} {r['routed']:>6} {r['hit_ratio']:>5.2f} {r['blind']:>5} {r['window_s']:>8.2f} {serving:>9}")
        if "stale_after_s" in r:
            print(f"{'':<14} the cut-off replica stopped answering {r['stale_after_s']:.2f} s after the cut")
        if "failover_s" in r:
            print(f"{'':<14} the sentinels named a new primary {r['failover_s']:.2f} s after the kill")
        if "over_zero_s" in r:
            print(f"{'':<14} no replica over-claimed {r['over_zero_s']:.2f} s after every replica served again")
    print(f"\nlogs: {logs_root}")
    return 1 if failed else 0


if __name__ == "__main__":
    h.run_main(main)
