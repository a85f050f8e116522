#!/usr/bin/env python3
"""Fault tests of a fleet of Indexer replicas on a shared Redis stream, with real processes on
loopback: after each fault, do all replicas hold the same index, and does it claim nothing a
worker does not hold? And what did the router see while it happened?

Fleet (from fault_tests.py): a real `redis-server` (append-only file on), --replicas Indexer
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

    scripts/fleet_tests.py [--only kill9,roll] [--replicas 2] [--base-port 47900]

Exit status 1 when a case over-claims, ends with digests that differ, or fails. Needs
redis-server (scripts/install_redis.sh); only the Python standard library otherwise.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crash_tests as ct  # noqa: E402  (router decisions)
import fault_tests as ft  # noqa: E402  (the fleet, traffic and views)

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
MAX_LAG_MS = 1000


def redis_command(port, *args, timeout=10):
    """Sends one command (RESP) and returns the first line of the answer."""
    payload = f"*{len(args)}\r\n" + "".join(f"${len(str(a).encode())}\r\n{a}\r\n" for a in args)
    with socket.create_connection((ft.HOST, port), timeout=timeout) as sock:
        sock.sendall(payload.encode())
        return sock.makefile("rb").readline().decode().strip()


def sentinel_master_port(port):
    """The port of the primary the sentinel on `port` names now (None when it names none)."""
    payload = "*3\r\n$8\r\nSENTINEL\r\n$23\r\nget-master-addr-by-name\r\n$8\r\nmymaster\r\n"
    with socket.create_connection((ft.HOST, port), timeout=5) as sock:
        sock.sendall(payload.encode())
        reply = sock.makefile("rb")
        if reply.readline().strip() != b"*2":
            return None
        lines = [reply.readline().strip() for _ in range(4)]
        return int(lines[3])


class Proxy:
    """A TCP proxy to Redis that can stop forwarding (a partition: the connections stay open,
    nothing arrives either way)."""

    def __init__(self, listen_port, target_port):
        self.target = target_port
        self.flowing = threading.Event()
        self.flowing.set()
        self.sockets = []
        self.server = socket.create_server((ft.HOST, listen_port))
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection((ft.HOST, self.target), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self.sockets += [client, upstream]
            for a, b in [(client, upstream), (upstream, client)]:
                threading.Thread(target=self.pump, args=(a, b), daemon=True).start()

    def pump(self, source, sink):
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                self.flowing.wait()
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.close()
            except OSError:
                pass

    def close(self):
        """Stops listening and drops every connection (the next case gets the port)."""
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        except OSError:
            pass
        self.server.close()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self.flowing.set()


class ReplicaFleet:
    def __init__(self, args, logs, min_replicas=None):
        """With `min_replicas`, the replicas find Redis through three sentinels watching it
        and a Redis replica of it, and wait for that many Redis replicas per append."""
        self.args, self.logs = args, logs
        self.min_replicas = min_replicas
        base = args.base_port
        self.redis_port, proxy_port = base + 5, base + 6
        self.redis_dir = os.path.join(logs, "redis")
        os.makedirs(self.redis_dir)
        self.redis = ft.Proc(logs, "redis", self.redis_argv(appendonly=True))
        ft.wait_until(lambda: redis_command(self.redis_port, "PING") == "+PONG", "redis-server")
        if min_replicas is not None:
            self.start_sentinels()
        self.proxy = Proxy(proxy_port, self.redis_port)
        self.replicas = args.replicas

        def extra(k):
            port = self.redis_port if k < args.replicas - 1 or args.replicas == 1 else proxy_port
            return self.replica_flags(k, port)

        self.fleet = ft.Fleet(args, logs, replicas=args.replicas, replica_extra=extra)
        self.wait_all_fresh()
        router_port = base + 2
        self.router_url = f"http://{ft.HOST}:{router_port}"
        self.router = ft.Proc(logs, "router", [f"{ft.BIN}/kv-indexer-router", "--listen-addr",
                                               f"{ft.HOST}:{router_port}", "--worker-urls", ",".join(self.fleet.urls),
                                               "--kv-indexer-endpoint", ",".join(self.fleet.endpoints),
                                               "--cache-affinity-min-matched-tokens", "16"])
        ft.wait_until(lambda: ft.http_ok(f"{self.router_url}/health"), "the router")

    def start_sentinels(self):
        """Redis replicas of the primary (one more than MIN_REPLICAS asks for, so that writes
        go on when one of them is promoted), and three sentinels (quorum 2, down after 1 s)."""
        base = self.args.base_port
        for r in range(self.min_replicas + 1):
            replica_dir = os.path.join(self.logs, f"redis-replica-{r}")
            os.makedirs(replica_dir)
            ft.Proc(self.logs, f"redis-replica-{r}", [
                "redis-server", "--bind", ft.HOST, "--port", str(base + 7 + r), "--save", "", "--appendonly",
                "no", "--dir", replica_dir, "--protected-mode", "no", "--repl-diskless-sync-delay", "0",
                "--replicaof", ft.HOST, str(self.redis_port)])
        wanted = str(self.min_replicas + 1)
        ft.wait_until(lambda: redis_command(self.redis_port, "WAIT", wanted, "100") == f":{wanted}",
                      "the Redis replicas' sync")
        self.sentinel_ports = [base + 50 + i for i in range(3)]
        for i, port in enumerate(self.sentinel_ports):
            conf = os.path.join(self.logs, f"sentinel-{i}.conf")
            with open(conf, "w") as f:
                f.write(f"port {port}\nbind {ft.HOST}\ndir {self.logs}\n"
                        f"sentinel monitor mymaster {ft.HOST} {self.redis_port} 2\n"
                        "sentinel down-after-milliseconds mymaster 1000\n"
                        "sentinel failover-timeout mymaster 5000\n")
            ft.Proc(self.logs, f"sentinel-{i}", ["redis-server", conf, "--sentinel"])
            ft.wait_until(lambda: redis_command(port, "PING") == "+PONG", f"sentinel {i}")

    def redis_argv(self, appendonly):
        return ["redis-server", "--bind", ft.HOST, "--port", str(self.redis_port), "--save", "",
                "--appendonly", "yes" if appendonly else "no", "--appendfsync", "everysec",
                "--dir", self.redis_dir, "--protected-mode", "no", "--repl-diskless-sync-delay", "0"]

    def replica_flags(self, k, redis_port):
        if self.min_replicas is None:
            log = [f"redis://{ft.HOST}:{redis_port}/0"]
        else:
            hosts = ",".join(f"{ft.HOST}:{port}" for port in self.sentinel_ports)
            log = [f"redis+sentinel://{hosts}/mymaster/0", "--event-log-min-replicas", str(self.min_replicas)]
        return ["--event-log", *log, "--metrics-addr", self.admin(k),
                "--state-dir", os.path.join(self.logs, f"state-{k}"), "--snapshot-interval-s", "2",
                "--max-lag-ms", str(MAX_LAG_MS)]

    def admin(self, k):
        port = self.args.base_port + 1 if k == 0 else self.args.base_port + 400 + k
        return f"{ft.HOST}:{port}"

    def state(self, k):
        with urllib.request.urlopen(f"http://{self.admin(k)}/state", timeout=10) as r:
            return json.loads(r.read())

    def fresh(self, k):
        try:
            return self.state(k).get("fresh", False)
        except Exception:
            return False

    def wait_fresh(self, k, timeout=60.0):
        start = time.time()
        ft.wait_until(lambda: self.fresh(k), f"replica {k} to serve", timeout=timeout, interval=0.01)
        return time.time() - start

    def wait_all_fresh(self):
        for k in range(self.replicas):
            self.wait_fresh(k)

    def digests(self):
        return [self.state(k)["digest"] for k in range(self.replicas)]

    def wait_converged(self, timeout=60.0):
        """Waits until every replica's digest is equal and stays so over 1 s (the bridges'
        heartbeats still flow: two reads a moment apart may straddle one)."""
        def equal_and_stable():
            first = self.digests()
            if len(set(first)) != 1:
                return False
            time.sleep(1.0)
            return self.digests() == first
        ft.wait_until(equal_and_stable, "every replica's digest to be equal", timeout=timeout, interval=0.1)

    def restart(self, k, sig):
        proc = self.fleet.servers[k]
        proc.popen.send_signal(sig)
        proc.popen.wait(timeout=60)
        time.sleep(self.args.down_s if sig == signal.SIGKILL else 0.0)
        proc.start()
        return self.wait_fresh(k)


def time_to_no_over_claims(fleet, traffic, paused):
    """Seconds until no replica over-claims. Traffic pauses while they are counted: with it,
    events in flight always show some (a block evicted, its removal not yet applied)."""
    served = time.time()
    paused.set()
    try:
        replicas = fleet.fleet
        ft.wait_until(lambda: all(replicas.over_claimed(traffic, e) == 0 for e in replicas.endpoints),
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
        start = time.time()
        k = fleet.replicas
        port = fleet.args.base_port + 300 + k
        fleet.fleet.servers.append(ft.Proc(fleet.logs, f"server-{k}", [
            f"{ft.BIN}/kv-indexer-server", "--listen-addr", f"{ft.HOST}:{port}",
            *fleet.replica_flags(k, fleet.redis_port)]))
        fleet.replicas += 1
        fleet.wait_fresh(k)
        notes["to_serving_s"] = time.time() - start
    elif name == "redis-restart":
        fleet.redis.popen.send_signal(signal.SIGTERM)
        fleet.redis.popen.wait(timeout=30)
        time.sleep(fleet.args.down_s)
        fleet.redis.start()
        ft.wait_until(lambda: redis_command(fleet.redis_port, "PING") == "+PONG", "redis-server again")
        start = time.time()
        fleet.wait_all_fresh()
        notes["to_serving_s"] = time.time() - start
    elif name == "flushall":
        redis_command(fleet.redis_port, "FLUSHALL")
        time.sleep(2.0)
        start = time.time()
        fleet.wait_all_fresh()
        notes["to_serving_s"] = time.time() - start
    elif name == "rollback":
        # What a failover to a lagging Redis replica or a restore from backup does: the engine
        # comes back holding less than it acknowledged (the RDB of 2 s ago, its AOF gone).
        redis_command(fleet.redis_port, "SAVE")
        time.sleep(2.0)
        fleet.redis.kill9()
        shutil.rmtree(os.path.join(fleet.redis_dir, "appendonlydir"), ignore_errors=True)
        fleet.redis = ft.Proc(fleet.logs, "redis-older", fleet.redis_argv(appendonly=False))
        ft.wait_until(lambda: redis_command(fleet.redis_port, "PING") == "+PONG", "redis-server again")
        start = time.time()
        fleet.wait_all_fresh()
        notes["to_serving_s"] = time.time() - start
        notes["over_zero_s"] = time_to_no_over_claims(fleet, traffic, paused)
    elif name.startswith("sentinel-"):
        # The primary dies under load; the sentinels promote a replica, the replicas follow;
        # the old primary comes back and the sentinels make it a replica of the new one.
        fleet.redis.kill9()
        ft.wait_until(lambda: sentinel_master_port(fleet.sentinel_ports[0]) != fleet.redis_port,
                      "the sentinels' failover", timeout=30, interval=0.05)
        notes["failover_s"] = time.time() - started
        fleet.redis.start()
        start = time.time()
        fleet.wait_all_fresh()
        notes["to_serving_s"] = time.time() - start
        notes["over_zero_s"] = time_to_no_over_claims(fleet, traffic, paused)
    elif name == "partition":
        k = fleet.replicas - 1
        fleet.proxy.flowing.clear()
        cut = time.time()
        ft.wait_until(lambda: not fleet.fresh(k), "the cut-off replica to stop answering", timeout=10, interval=0.01)
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
    fleet = ReplicaFleet(args, logs, int(name[-1]) if name.startswith("sentinel-") else None)
    traffic = ft.Traffic(args, seed)
    try:
        traffic.burst(fleet.fleet.urls, args.before)
        settled = ft.settle(fleet.fleet, traffic, time.time(), args)
        if settled["over"] or settled["under"]:
            raise RuntimeError(f"the index did not match the workers before the fault: {settled}")
        fleet.wait_converged()
        # The routing window.
        before = ct.router_decisions(fleet.router_url)
        stop, paused = threading.Event(), threading.Event()

        def loop():
            while not stop.is_set():
                if paused.is_set():
                    time.sleep(0.01)
                    continue
                traffic.one(fleet.router_url)

        senders = [threading.Thread(target=loop, daemon=True) for _ in range(4)]
        for s in senders:
            s.start()
        time.sleep(1.0)
        started = time.time()
        notes = fault(name, fleet, traffic, paused)
        window = time.time() - started
        time.sleep(1.0)
        stop.set()
        for s in senders:
            s.join(timeout=30)
        decisions = ct.diff(ct.router_decisions(fleet.router_url), before)
        routed = sum(decisions.values())
        hits = ct.hit_decisions(decisions)
        blind = sum(ct.blind_decisions(decisions).values())
        # Quiet: every replica equal, and the index against the workers.
        fleet.wait_all_fresh()
        settled = ft.settle(fleet.fleet, traffic, time.time(), args)
        try:
            fleet.wait_converged()
            converged = True
        except RuntimeError:
            converged = False
        digests = fleet.digests()
        return dict(routed=routed, hit_ratio=hits / max(routed, 1), blind=blind, window_s=window,
                    expected=settled["expected"], over=settled["over"], under=settled["under"],
                    digests_equal=converged and len(set(digests)) == 1, digests=digests, replicas=len(digests), decisions=decisions, **notes)
    finally:
        ft.stop_all()
        fleet.proxy.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(CASES), help="comma-separated cases: " + ", ".join(CASES))
    ap.add_argument("--replicas", type=int, default=2)
    ft.add_fleet_args(ap, workers=2, base_port=47900, docs=24, capacity_tokens=1 << 20,
                      host_capacity_tokens=1 << 20, stable_s=3.0, deadline_s=40.0, poll_s=0.2, seed=13)
    ap.add_argument("--before", type=int, default=40)
    ap.add_argument("--after", type=int, default=0)
    args = ap.parse_args()
    cases = ft.selected(ap, args.only, CASES)
    if not shutil.which("redis-server"):
        ap.error("redis-server is not installed: run scripts/install_redis.sh")
    ft.build(args, "sgl-kv-indexer", "kv-indexer-tools", "kv-indexer-router")
    logs_root = tempfile.mkdtemp(prefix="kv-fleet-tests-")
    signal.signal(signal.SIGTERM, lambda s, _f: (ft.stop_all(), sys.exit(128 + s)))
    rows, failed = ft.run_cases(cases, CASES.get, lambda name, k: run_case(args, name, logs_root, args.seed + k))
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
    ft.run_main(main)
