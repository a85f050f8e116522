#!/usr/bin/env python3
"""Fault tests with real processes on loopback: does the Indexer ever claim a block a worker
does not hold (an over-claim) when processes die, restart or lose messages?

Each fault runs on a fresh fleet: the Indexer, --workers simulated SGLang workers
(`kv-indexer-sim`, small caches so traffic evicts, a host tier) and one bridge per worker, all
on 127.0.0.1. Traffic is /generate requests sent straight to the workers: prompts made of one
of --docs shared documents plus a unique suffix, so prefixes are shared within and across
workers and the caches evict on both tiers. Per fault: a burst before, steady traffic during
the fault, a burst after; then quiet. The index is then polled (MatchExternalKv through
`kv-indexer-ctl match --json`, every hash any prompt could have stored) together with each
worker's own view (`GET /cache_view`) until the index matches the workers exactly or stops
changing (--stable-s), within a deadline.

Columns: placements expected (worker, tier, block triples the workers hold), held (those the
index also holds), over-claimed (triples in the index the worker does not hold: must be 0),
under-claimed (expected - held), time to converge (from the end of the fault: the restarted
process is up, or for drop faults the last request, to the first poll showing the final state).

Faults: none (control); kill -9 the server mid-stream and restart it on the same port; kill -9
a bridge and restart it (with replay, and without); kill -9 a worker and restart it (sequence
from 0, empty cache); --drop-every with replay; with a replay buffer that evicts; with no
replay.

    scripts/fault_tests.py [--only server-kill,sim-restart] [--workers 2] [--base-port 47300]
    scripts/fault_tests.py --only sim-restart-busy --repeat 20   # a flaky fault, in a loop

A bridge must never exit on its own (only a misconfiguration or a permanent status from the
Indexer may stop it): every run counts the bridges that exited, and the summary gives the total.
Exit status 1 when any fault over-claims, does not settle, or loses a bridge. Only the Python standard library;
the binaries are built with cargo (release) unless --no-build.
"""

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target/release")
PAGE = 16
HOST = "127.0.0.1"
TIERS = {"GPU": "HBM", "CPU_PINNED": "DRAM"}  # the worker's tier names -> the index's
MAX_MATCH_HASHES = 16384

# Every process started, so that any exit path stops them (by pid, never by name).
ALL_PROCS = []


def block_hashes(tokens):
    """SGLang's block hashes of the full pages of `tokens` (ids below 2^32): SHA-256 chained
    over the previous digest, tokens as u32 little-endian, first 8 bytes as a signed i64."""
    out, prior = [], b""
    for start in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        h = hashlib.sha256(prior)
        h.update(b"".join(t.to_bytes(4, "little") for t in tokens[start:start + PAGE]))
        prior = h.digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


def http_json(url, body=None, timeout=10):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_until(check, what, timeout=30.0, interval=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(interval)
    raise RuntimeError(f"timed out waiting for {what}")


def http_ok(url):
    with urllib.request.urlopen(url, timeout=1) as resp:
        return resp.status == 200


def rss_mib(pid):
    """The resident memory (VmRSS) of process `pid`, in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def tcp_open(port):
    with socket.create_connection((HOST, port), timeout=0.5):
        return True


# The options Fleet, Traffic and settle read, shared by the scripts that run a fleet: (flag, type,
# default where most scripts agree, help).
FLEET_OPTIONS = [
    ("--workers", int, None, None),
    ("--base-port", int, None, None),
    ("--docs", int, None, "shared documents (prefixes)"),
    ("--doc-tokens", int, 512, None),
    ("--suffix-tokens", int, 64, None),
    ("--capacity-tokens", int, None, "each worker's device cache"),
    ("--host-capacity-tokens", int, None, "each worker's host tier"),
    ("--down-s", float, 1.0, "how long a killed process stays down"),
    ("--stable-s", float, None,
     "settled when the index has not changed for this long (longer than the bridge's backoff steps)"),
    ("--deadline-s", float, None, None),
    ("--poll-s", float, None, None),
    ("--seed", int, None, None),
]


def add_fleet_args(ap, **defaults):
    """Adds FLEET_OPTIONS and --no-build to `ap`; `defaults` (base_port=47300, ...) gives the
    script's own default for an option, and must for those without a shared one."""
    for flag, kind, default, help in FLEET_OPTIONS:
        ap.add_argument(flag, type=kind, default=defaults.pop(flag[2:].replace("-", "_"), default), help=help)
    if defaults:
        raise TypeError(f"not fleet options: {sorted(defaults)}")
    ap.add_argument("--no-build", action="store_true")


def selected(ap, only, known, what="case"):
    """The comma-separated names of `only`, each one of `known` (else `ap` exits naming it)."""
    names = [name for name in only.split(",") if name]
    for name in names:
        if name not in known:
            ap.error(f"unknown {what} {name!r}")
    return names


def build(args, *packages):
    """Builds the release binaries of `packages` with cargo, unless --no-build."""
    if not args.no_build:
        argv = ["cargo", "build", "--release", "-q"]
        for package in packages:
            argv += ["-p", package]
        subprocess.run(argv, cwd=ROOT, check=True)


class Proc:
    """One binary, restartable with the same arguments."""

    def __init__(self, logs, name, argv, env=None):
        self.logs, self.name, self.argv, self.env = logs, name, argv, env
        self.popen = None
        self.starts = 0
        self.start()

    def start(self):
        self.starts += 1
        log = open(os.path.join(self.logs, f"{self.name}.{self.starts}.log"), "w")
        self.popen = subprocess.Popen(self.argv, stdout=log, stderr=log, env=self.env,
                                      stdin=subprocess.DEVNULL)
        log.close()
        ALL_PROCS.append(self.popen)

    def kill9(self):
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def alive(self):
        return self.popen.poll() is None


def stop(procs, timeout=5):
    """SIGTERM to each of `procs` still running, then SIGKILL to those not gone in `timeout` s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout)


def stop_all():
    stop(ALL_PROCS)
    ALL_PROCS.clear()


def run_main(main):
    """Exits with `main()`'s status, stopping every process the run started whatever happens."""
    try:
        sys.exit(main())
    finally:
        stop_all()


class Fleet:
    """The Indexer (or `replicas` of it, the first on --base-port, replica k on base + 300 + k,
    with `replica_extra(k)`'s flags), the simulated workers and a bridge each, whose
    KV_INDEXER_ENDPOINT lists every replica."""

    def __init__(self, args, logs, sim_extra=(), replay=True, server_extra=(), replicas=1,
                 replica_extra=lambda k: []):
        self.args, self.logs = args, logs
        base = args.base_port
        self.indexer_port = base
        self.ports = [base] + [base + 300 + k for k in range(1, replicas)]
        self.endpoints = [f"http://{HOST}:{port}" for port in self.ports]
        self.endpoint = self.endpoints[0]
        self.servers = [Proc(logs, "server" if k == 0 else f"server-{k}",
                             [f"{BIN}/kv-indexer-server", "--listen-addr", f"{HOST}:{port}",
                              *server_extra, *replica_extra(k)])
                        for k, port in enumerate(self.ports)]
        self.server = self.servers[0]
        self.sims, self.bridges, self.urls, self.ids = [], [], [], []
        for i in range(args.workers):
            http_port, events, replay_port = base + 10 + i, base + 100 + i, base + 200 + i
            argv = [f"{BIN}/kv-indexer-sim", "--host", HOST, "--port", str(http_port),
                    "--kv-events-host", HOST, "--kv-events-port", str(events),
                    "--page-size", str(PAGE), "--capacity-tokens", str(args.capacity_tokens),
                    "--host-capacity-tokens", str(args.host_capacity_tokens),
                    "--prefill-us-per-token", "1", "--decode-us-per-token", "100", *sim_extra]
            if replay:
                argv += ["--replay-port", str(replay_port)]
            self.sims.append(Proc(logs, f"sim-{i}", argv))
            env = dict(os.environ, KV_INDEXER_WORKER_ID=f"sim-{i}",
                       KV_INDEXER_WORKER_ADDRESS=f"http://{HOST}:{http_port}",
                       SGLANG_KV_EVENT_ENDPOINT=f"tcp://{HOST}:{events}",
                       SGLANG_KV_EVENT_TOPIC="kv-events", KV_INDEXER_ENDPOINT=",".join(self.endpoints),
                       RUST_LOG="info")
            env.pop("SGLANG_KV_REPLAY_ENDPOINT", None)
            if replay:
                env["SGLANG_KV_REPLAY_ENDPOINT"] = f"tcp://{HOST}:{replay_port}"
            self.bridges.append(Proc(logs, f"bridge-{i}", [f"{BIN}/kv-indexer-bridge"], env))
            self.urls.append(f"http://{HOST}:{http_port}")
            self.ids.append(f"sim-{i}")
        for port in self.ports:
            wait_until(lambda: tcp_open(port), "the server")
        for url in self.urls:
            wait_until(lambda: http_ok(f"{url}/health"), f"{url}")
        time.sleep(1.0)  # bridges subscribe (and replay from seq 0)
        self.check_alive()

    def exited_bridges(self):
        """The bridges that exited on their own, with their exit status and last log line."""
        exited = []
        for p in self.bridges:
            if not p.alive():
                log = os.path.join(self.logs, f"{p.name}.{p.starts}.log")
                with open(log, errors="replace") as f:
                    lines = [line.rstrip() for line in f if line.strip()]
                tail = " | ".join(lines[-4:])
                exited.append(f"{p.name} exited with {p.popen.returncode}: {tail}")
        return exited

    def check_alive(self):
        for p in [*self.servers, *self.sims, *self.bridges]:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}; see {self.logs}")

    def restart_server(self):
        self.server.kill9()
        time.sleep(self.args.down_s)
        self.server.start()
        wait_until(lambda: tcp_open(self.indexer_port), "the restarted server")

    def restart_bridge(self, i):
        self.bridges[i].kill9()
        time.sleep(self.args.down_s)
        self.bridges[i].start()
        time.sleep(0.2)

    def restart_sim(self, i, down_s=None):
        self.sims[i].kill9()
        time.sleep(self.args.down_s if down_s is None else down_s)
        # The ports were just closed: retry a few times if binding fails.
        for _ in range(20):
            self.sims[i].start()
            try:
                wait_until(lambda: http_ok(f"{self.urls[i]}/health"), "the restarted worker", timeout=3)
                return
            except RuntimeError:
                pass
            if self.sims[i].alive():
                return
            time.sleep(0.25)
        raise RuntimeError("the worker did not restart")

    # -- views --------------------------------------------------------------------------------

    def worker_views(self):
        """{worker_id: set((tier, hash))} as each worker's cache holds them."""
        views = {}
        for wid, url in zip(self.ids, self.urls):
            view = http_json(f"{url}/cache_view")
            views[wid] = {(TIERS[t], h) for t, hashes in view["tiers"].items() for h in hashes}
        return views

    def index_view(self, universe, endpoint=None):
        """{worker_id: set((tier, hash))} as the index (at `endpoint`, default the first
        replica) holds them, over `universe`."""
        held = {}
        hashes = sorted(universe)
        for start in range(0, len(hashes), MAX_MATCH_HASHES):
            chunk = hashes[start:start + MAX_MATCH_HASHES]
            out = subprocess.run(
                [f"{BIN}/kv-indexer-ctl", "--endpoint", endpoint or self.endpoint, "--json", "match", "--",
                 *map(str, chunk)], capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                raise RuntimeError(f"kv-indexer-ctl match failed: {out.stdout} {out.stderr}")
            for node in json.loads(out.stdout)["matches"]:
                dest = held.setdefault(node["worker_id"], set())
                for tier in node["tiers"]:
                    dest.update((tier["tier"], h) for h in tier["hashes"])
        return held

    def over_claimed(self, traffic, endpoint=None):
        """Placements the index (at `endpoint`, default the first replica) claims that no
        worker holds now, over every hash `traffic` could have stored."""
        workers = self.worker_views()
        universe = traffic.universe | {h for v in workers.values() for _, h in v}
        return compare(workers, self.index_view(universe, endpoint))[2]


class Traffic:
    """Prompts with shared prefixes to every worker; remembers every hash they could store."""

    def __init__(self, args, seed):
        self.args = args
        self.rng = random.Random(seed)
        self.universe = set()
        self.sent = self.errors = 0
        self.suffix = 0
        self.lock = threading.Lock()

    def prompt(self):
        with self.lock:
            doc = self.rng.randrange(self.args.docs)
            self.suffix += 1
            suffix = self.suffix
        prefix = [doc * 100_000 + j for j in range(self.args.doc_tokens)]
        tail = [50_000_000 + suffix * 1000 + j for j in range(self.args.suffix_tokens)]
        return prefix + tail

    def one(self, url):
        tokens = self.prompt()
        with self.lock:
            self.universe.update(block_hashes(tokens))
        try:
            out = http_json(f"{url}/generate", {"input_ids": tokens,
                                                 "sampling_params": {"max_new_tokens": 1}})
            with self.lock:
                self.universe.update(block_hashes(tokens + out.get("output_ids", [])))
                self.sent += 1
        except Exception:
            with self.lock:
                self.errors += 1

    def burst(self, urls, per_worker):
        for _ in range(per_worker):
            for url in urls:
                self.one(url)

    def background(self, urls):
        """Steady traffic until the returned event is set (bounded: at most 100,000 requests)."""
        stop = threading.Event()

        def run():
            for _ in range(100_000):
                if stop.is_set():
                    return
                for url in urls:
                    self.one(url)
                time.sleep(0.005)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return stop, thread


def run_cases(names, describe, run):
    """Runs `run(name, k)` for each case in turn, saying which runs; returns [(name, result)]
    with None for a case that raised (its error printed), and whether any did."""
    rows, failed = [], False
    for k, name in enumerate(names):
        print(f"running {name}: {describe(name)} …", file=sys.stderr, flush=True)
        try:
            rows.append((name, run(name, k)))
        except Exception as error:
            print(f"  {name} failed: {error}", file=sys.stderr)
            rows.append((name, None))
            failed = True
    return rows, failed


def compare(workers, index):
    expected = sum(len(v) for v in workers.values())
    held = over = 0
    over_examples = []
    for wid in set(workers) | set(index):
        w, i = workers.get(wid, set()), index.get(wid, set())
        held += len(w & i)
        extra = i - w
        over += len(extra)
        over_examples += [(wid, *e) for e in sorted(extra)[:3]]
    return expected, held, over, expected - held, over_examples


def settle(fleet, traffic, t0, args):
    """Polls until the index equals the workers' views, or stops changing for --stable-s."""
    deadline = time.time() + args.deadline_s
    last_state, since = None, None
    stable_since = time.time()
    while True:
        workers = fleet.worker_views()
        universe = traffic.universe | {h for v in workers.values() for _, h in v}
        index = fleet.index_view(universe)
        now = time.time()
        state = (frozenset((w, frozenset(v)) for w, v in workers.items()),
                 frozenset((w, frozenset(v)) for w, v in index.items() if v))
        if state != last_state:
            last_state, since, stable_since = state, now, now
        expected, held, over, under, examples = compare(workers, index)
        exact = over == 0 and under == 0
        if exact or now - stable_since >= args.stable_s:
            return dict(expected=expected, held=held, over=over, under=under,
                        converge=since - t0, settled=True, examples=examples,
                        unknown=len({h for v in workers.values() for _, h in v} - traffic.universe))
        if now > deadline:
            return dict(expected=expected, held=held, over=over, under=under,
                        converge=now - t0, settled=False, examples=examples, unknown=0)
        time.sleep(args.poll_s)


FAULTS = {
    # name: (sim flags, replay, description)
    "none": ((), True, "no fault (control)"),
    "server-kill": ((), True, "kill -9 the server, restart on the same port"),
    "bridge-kill": ((), True, "kill -9 a bridge, restart it (replay)"),
    "bridge-kill-noreplay": ((), False, "kill -9 a bridge, restart it (no replay)"),
    "sim-restart": ((), True, "kill -9 a worker, restart it (seq 0, empty)"),
    "sim-restart-busy": ((), True, "same, 3 s down, busy before the bridge reconnects"),
    "sim-restart-bridge-down": ((), True, "worker restarts while its bridge is down"),
    "drop-replay": (("--drop-every", "7"), True, "drop every 7th message, replay"),
    "drop-evicting-replay": (("--drop-every", "7", "--replay-buffer-steps", "2"), True,
                             "drop every 7th, replay buffer of 2 steps"),
    "drop-noreplay": (("--drop-every", "7"), False, "drop every 7th message, no replay"),
}


class BridgeExited(RuntimeError):
    """Bridges exited during a fault: the fault loop counts them."""

    def __init__(self, exited):
        super().__init__("; ".join(exited))
        self.count = len(exited)


def run_fault(args, name, logs_root, seed, run=0):
    sim_extra, replay, _ = FAULTS[name]
    logs = os.path.join(logs_root, name if run == 0 else f"{name}.{run}")
    os.makedirs(logs)
    fleet = Fleet(args, logs, sim_extra, replay)
    traffic = Traffic(args, seed)
    try:
        traffic.burst(fleet.urls, args.before)
        stop, thread = traffic.background(fleet.urls)
        time.sleep(args.during_s / 2)
        if name == "server-kill":
            fleet.restart_server()
        elif name.startswith("bridge-kill"):
            fleet.restart_bridge(0)
        elif name == "sim-restart":
            fleet.restart_sim(0)
        elif name == "sim-restart-busy":
            # Down long enough for the subscriber's reconnect backoff to grow, then busy at
            # once: the new publisher's sequence passes the old one before the bridge is back.
            fleet.restart_sim(0, down_s=3.0)
            traffic.burst(fleet.urls[:1], args.busy_requests)
        elif name == "sim-restart-bridge-down":
            fleet.bridges[0].kill9()
            fleet.restart_sim(0)
            traffic.burst(fleet.urls[:1], 5)
            fleet.bridges[0].start()
        t0 = time.time()
        time.sleep(args.during_s / 2)
        stop.set()
        thread.join(timeout=60)
        traffic.burst(fleet.urls, args.after)
        if name.startswith("drop") or name == "none":
            t0 = time.time()  # the fault lasts as long as the traffic
        exited = fleet.exited_bridges()
        if exited:
            raise BridgeExited(exited)
        fleet.check_alive()
        result = settle(fleet, traffic, t0, args)
        exited = fleet.exited_bridges()
        if exited:
            raise BridgeExited(exited)
        result.update(requests=traffic.sent, errors=traffic.errors)
        return result
    finally:
        stop_all()


def result_row(name, r):
    """One fault's line of the summary table; `r` is None when the fault failed to run."""
    head = f"{name:<22} {FAULTS[name][2]:<44}"
    if r is None:
        return f"{head} {'ERROR':>8}"
    conv = f"{r['converge']:.2f}" + ("" if r["settled"] else " (deadline)")
    return (f"{head} {r['requests']:>8} {r['expected']:>9} {r['held']:>6} "
            f"{r['over']:>5} {r['under']:>6} {conv:>10}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(FAULTS), help="comma-separated faults: " + ", ".join(FAULTS))
    add_fleet_args(ap, workers=2, base_port=47300, docs=24, capacity_tokens=4096, host_capacity_tokens=8192,
                   stable_s=4.0, deadline_s=40.0, poll_s=0.2, seed=7)
    ap.add_argument("--before", type=int, default=30, help="requests per worker before the fault")
    ap.add_argument("--after", type=int, default=15, help="requests per worker after the fault")
    ap.add_argument("--during-s", type=float, default=2.0, help="steady traffic around the fault")
    ap.add_argument("--busy-requests", type=int, default=300,
                    help="requests to the restarted worker at once (sim-restart-busy)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the selected faults this many times (each run a fresh fleet and seed)")
    args = ap.parse_args()
    faults = selected(ap, args.only, FAULTS, "fault")

    build(args, "sgl-kv-indexer", "kv-indexer-tools")
    logs_root = tempfile.mkdtemp(prefix="kv-fault-tests-")

    def on_signal(signum, _frame):
        stop_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    rows, failed, bridge_exits = [], False, 0
    runs = [(run, k, name) for run in range(args.repeat) for k, name in enumerate(faults)]
    try:
        for run, k, name in runs:
            label = name if args.repeat == 1 else f"{name} (run {run + 1}/{args.repeat})"
            print(f"running {label}: {FAULTS[name][2]} …", file=sys.stderr, flush=True)
            try:
                r = run_fault(args, name, logs_root, args.seed + k + run * len(faults), run)
            except Exception as error:  # report and go on with the next fault
                if isinstance(error, BridgeExited):
                    bridge_exits += error.count
                print(f"  {label} failed: {error}", file=sys.stderr)
                rows.append((name, None))
                failed = True
                continue
            if r["over"] or not r["settled"]:
                failed = True
            if r["over"]:
                print(f"  OVER-CLAIM examples (worker, tier, hash): {r['examples']}", file=sys.stderr)
            rows.append((name, r))
    finally:
        stop_all()

    print()
    print(f"{'fault':<22} {'description':<44} {'requests':>8} {'expected':>9} {'held':>6} "
          f"{'over':>5} {'under':>6} {'converge_s':>10}")
    for name, r in rows:
        print(result_row(name, r))
    print(f"\nlogs: {logs_root}")
    print(f"bridge exits: {bridge_exits} in {len(runs)} runs")
    print("over-claims: " + ("NONE" if not any(r and r["over"] for _, r in rows) else "FOUND"))
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
