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

    scripts/fault_tests.py [--only server-kill,sim-restart] [--workers 2] [--base-port 27300]
    scripts/fault_tests.py --only sim-restart-busy --repeat 20   # a flaky fault, in a loop
    scripts/fault_tests.py --short --no-build --bin-dir target/debug   # CI: 4 faults, ~1 min

A bridge must never exit on its own (only a misconfiguration or a permanent status from the
Indexer may stop it): every run counts the bridges that exited, and the summary gives the total.
Exit status 1 when any fault over-claims, does not settle, or loses a bridge. Only the Python
standard library (the plumbing is harness.py); the binaries come from --bin-dir (default
target/release, under $CARGO_TARGET_DIR when set), built there with cargo unless --no-build.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402  (processes, the fleet, traffic, settle)

FAULTS = {
    # name: (sim flags, replay, description)
    "none": ((), True, "no fault (control)"),
    "server-kill": ((), True, "kill -9 the server, restart on the same port"),
    "bridge-kill": ((), True, "kill -9 a bridge, restart it (replay)"),
    "bridge-kill-noreplay": ((), False, "kill -9 a bridge, restart it (no replay)"),
    "sim-restart": ((), True, "kill -9 a worker, restart it (seq 0, empty)"),
    "sim-restart-busy": ((), True, "same, 3 s down, busy before the bridge reconnects"),
    "sim-restart-bridge-down": ((), True, "worker restarts while its bridge is down"),
    # With replay, a run whose last message was lost ends exact too: the bridge asks the replay
    # endpoint once its stream has been quiet for a second.
    "drop-replay": (("--drop-every", "7"), True, "drop every 7th message, replay"),
    "drop-evicting-replay": (("--drop-every", "7", "--replay-buffer-steps", "2"), True,
                             "drop every 7th, replay buffer of 2 steps"),
    # Without replay a lost message shows only at the next one, so losses stop at seq 56 (a short
    # run publishes about 100 batches per worker): a lost last one would leave its worker stale.
    "drop-noreplay": (("--drop-every", "7", "--drop-until", "56"), False, "drop every 7th message, no replay"),
}
# --short (CI): one fault of each kind the bridge rides out, with less traffic.
SHORT = ["server-kill", "bridge-kill", "sim-restart", "drop-replay"]
SHORT_DEFAULTS = dict(before=10, after=5, during_s=1.5)
BINARIES = ["kv-indexer-server", "kv-indexer-sim", "kv-indexer-bridge", "kv-indexer-ctl"]


class BridgeExited(RuntimeError):
    """Bridges exited during a fault: the fault loop counts them."""

    def __init__(self, exited):
        super().__init__("; ".join(exited))
        self.count = len(exited)


def run_fault(args, name, logs_root, seed, run=0):
    sim_extra, replay, _ = FAULTS[name]
    logs = os.path.join(logs_root, name if run == 0 else f"{name}.{run}")
    os.makedirs(logs)
    traffic = h.Traffic(args, seed)
    try:
        fleet = h.Fleet(args, logs, sim_extra, replay)
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
        result = h.settle(fleet, traffic, t0, args)
        exited = fleet.exited_bridges()
        if exited:
            raise BridgeExited(exited)
        result.update(requests=traffic.sent, errors=traffic.errors)
        return result
    finally:
        h.stop_all()


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
    h.add_fleet_args(ap, workers=2, base_port=27300, docs=24, capacity_tokens=4096, host_capacity_tokens=8192,
                     stable_s=4.0, deadline_s=40.0, poll_s=0.2, seed=7)
    ap.add_argument("--before", type=int, default=30, help="requests per worker before the fault")
    ap.add_argument("--after", type=int, default=15, help="requests per worker after the fault")
    ap.add_argument("--during-s", type=float, default=2.0, help="steady traffic around the fault")
    ap.add_argument("--busy-requests", type=int, default=300,
                    help="requests to the restarted worker at once (sim-restart-busy)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the selected faults this many times (each run a fresh fleet and seed)")
    args = h.parse_args(ap, SHORT, **SHORT_DEFAULTS)
    faults = h.selected(ap, args.only, FAULTS, "fault")

    h.build(args, "sgl-kv-indexer", "kv-indexer-tools", binaries=BINARIES)
    logs_root = tempfile.mkdtemp(prefix="kv-fault-tests-")

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
        h.stop_all()

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
    h.run_main(main)
