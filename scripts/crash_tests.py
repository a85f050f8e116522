#!/usr/bin/env python3
"""Crash tests of the durable Indexer with real processes on loopback: after the server dies
and restarts on its state directory, does the index hold exactly what every worker holds?

Fleet (harness.py's): the Indexer with KV_INDEXER_STATE_DIR, --workers simulated SGLang
workers with caches large enough that nothing is evicted (traffic after the fault could not
refill what the index lost: only recovery can), one bridge per worker, and kv-indexer-router.

Per case:
1. traffic to the workers; wait until the index equals every worker's /cache_view;
2. stop traffic; read the index digest (GET /state on the admin address);
3. the fault: kill -9 (sync batch or always or off), SIGTERM, or kill -9 at the moment a
   snapshot starts (a new log segment appears: the snapshot is being built; with traffic
   stopped, a bridge heartbeat is what starts it);
4. restart on the same directory; time to SERVING; the digest and the placements against
   every worker's view at once, with no traffic: over-claimed and under-claimed must be 0
   (with --log-sync off under-claims are allowed, over-claims never);
5. routing through the restart window: requests through the router while the server is killed
   and restarted again; the router's decisions by reason (blind = the Indexer gave no signal).

And `older-state`: the server restarted on an older copy of its state directory (a restored
volume snapshot): the time until nothing is over-claimed (the bridges re-sync at their next
numbered apply), then over- and under-claims once settled.

And `worker-gone`: a worker and its bridge killed for good, with KV_INDEXER_WORKER_TTL_S=3:
its placements must be gone after the TTL and a sweep (0 phantom placements), the live
worker's exact, and still gone after a restart.

    scripts/crash_tests.py [--only kill9-batch,sigterm] [--workers 2] [--base-port 27600]
    scripts/crash_tests.py --short --no-build --bin-dir target/debug   # CI: the 4 crashes, ~1 min

Exit status 1 when a case over-claims, under-claims where it must not, or changes the digest.
Only the Python standard library (the plumbing is harness.py); the binaries come from --bin-dir
(default target/release, under $CARGO_TARGET_DIR when set), built there unless --no-build.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402  (processes, the fleet, traffic, settle, the router)

CASES = {
    # name: (server flags, the fault, under-claims allowed, description)
    "kill9-batch": (["--log-sync", "batch"], "kill", False, "kill -9, --log-sync batch"),
    "kill9-always": (["--log-sync", "always"], "kill", False, "kill -9, --log-sync always"),
    "sigterm": (["--log-sync", "batch"], "term", False, "SIGTERM (final snapshot), restart"),
    "kill9-snapshot": (["--log-sync", "batch", "--snapshot-interval-s", "1"], "kill-in-snapshot", False,
                       "kill -9 as a snapshot is being built"),
    "kill9-sync-off": (["--log-sync", "off"], "kill", True, "kill -9, --log-sync off"),
}


# --short (CI): every way the server goes down with its state, with less traffic.
SHORT = ["kill9-batch", "kill9-always", "sigterm", "kill9-snapshot"]
SHORT_DEFAULTS = dict(before=15, during_s=1.0)
BINARIES = ["kv-indexer-server", "kv-indexer-sim", "kv-indexer-bridge", "kv-indexer-ctl", "kv-indexer-router"]


def wait_ready(admin, timeout=60.0):
    """Waits until the server on `admin` is SERVING; returns the seconds it took."""
    return h.wait_state(admin, "ready", "the restarted server to be SERVING", timeout=timeout)


def kill_in_snapshot(fleet, state_dir, timeout=30.0):
    """kill -9 the server right after a snapshot starts (a new log segment appears)."""
    def segments():
        return {n for n in os.listdir(state_dir) if n.endswith(".seg")}

    known = segments()
    deadline = time.time() + timeout
    while time.time() < deadline:
        now = segments()
        if now - known:
            fleet.server.kill9()
            return sorted(os.listdir(state_dir))
        time.sleep(0.0005)
    raise RuntimeError("no snapshot started")


def durable_fleet(args, logs, ports, *flags):
    """A fleet whose server keeps its state in logs/state, /state on ports.addr("admin");
    returns it and the state directory."""
    state_dir = os.path.join(logs, "state")
    os.makedirs(logs)
    server_extra = ["--state-dir", state_dir, "--metrics-addr", ports.addr("admin"), *flags]
    return h.Fleet(args, logs, server_extra=server_extra, ports=ports), state_dir


def run_case(args, name, logs_root, seed):
    flags, fault, under_ok, _ = CASES[name]
    ports = h.Ports(args.base_port)
    admin = ports.addr("admin")
    traffic = h.Traffic(args, seed)
    try:
        fleet, state_dir = durable_fleet(args, os.path.join(logs_root, name), ports, *flags)
        _, router_url = h.start_router(fleet.logs, ports, fleet.urls, [fleet.endpoint])
        traffic.burst(fleet.urls, args.before)
        stop, thread = traffic.background(fleet.urls)
        time.sleep(args.during_s)
        stop.set()
        thread.join(timeout=60)
        settled = h.settle_exactly(fleet, traffic, args)
        before = h.admin_state(admin)
        if fault == "kill":
            fleet.server.kill9()
        elif fault == "kill-in-snapshot":
            # Quiet now, but the bridges' heartbeats are records too: the next one starts a
            # snapshot (every second while the log grows), and the kill lands in it.
            files = kill_in_snapshot(fleet, state_dir)
        else:
            fleet.server.term()
        if fault != "kill-in-snapshot":
            files = sorted(os.listdir(state_dir))
        fleet.server.start()
        to_serving = wait_ready(admin)
        after = h.admin_state(admin)
        _, held, over, under, examples = fleet.check(traffic)
        result = dict(before=settled["expected"], after=held, over=over, under=under, to_serving=to_serving,
                      digest_equal=before["digest"] == after["digest"],
                      files=" ".join(f for f in files if not f.startswith("LOCK")),
                      disk_bytes=sum(os.path.getsize(os.path.join(state_dir, f)) for f in os.listdir(state_dir)),
                      examples=examples, under_ok=under_ok)
        result.update(routing_window(args, fleet, traffic, router_url, admin))
        return result
    finally:
        h.stop_all()


def worker_gone(args, logs_root, seed, ttl_s=3):
    """A worker and its bridge killed for good: its placements must go after the TTL and a
    sweep (0 phantom placements), the other worker's stay exact, and a restart agrees."""
    ports = h.Ports(args.base_port)
    traffic = h.Traffic(args, seed)
    try:
        fleet, _ = durable_fleet(args, os.path.join(logs_root, "worker-gone"), ports, "--worker-ttl-s", str(ttl_s))
        traffic.burst(fleet.urls, args.before)
        h.settle_exactly(fleet, traffic, args)
        gone, alive = fleet.ids[-1], fleet.ids[:-1]
        views = fleet.worker_views()
        universe = h.universe(traffic, views)

        def phantoms():
            return len(fleet.index_view(universe).get(gone, set()))

        phantom_at_kill = phantoms()
        fleet.bridges[-1].kill9()
        fleet.sims[-1].kill9()
        killed = time.time()
        h.wait_until(lambda: phantoms() == 0, "the dead worker's placements to go", timeout=ttl_s + 30, interval=0.1)
        purged_after = time.time() - killed
        live_views = {w: v for w, v in views.items() if w in alive}
        index = fleet.index_view(universe)
        _, _, over, under, _ = h.compare(live_views, {w: v for w, v in index.items() if w in alive})
        fleet.server.kill9()
        fleet.server.start()
        wait_ready(ports.addr("admin"))
        phantom_after_restart = phantoms()
        return dict(phantom_at_kill=phantom_at_kill, purged_after=purged_after, over=over, under=under,
                    phantom_after_restart=phantom_after_restart, ttl_s=ttl_s)
    finally:
        h.stop_all()


def older_state(args, logs_root, seed, capacity_tokens=4096):
    """The server restarted on an older copy of its state directory (a restored volume
    snapshot): it claims what the workers dropped since, and its bridges were told those
    batches were applied. Their next numbered apply shows the gap; the worker is cleared and
    re-synced from its publisher's buffer. Small caches, so the workers evict (drop) blocks."""
    logs = os.path.join(logs_root, "older-state")
    ports = h.Ports(args.base_port)
    admin = ports.addr("admin")
    small = argparse.Namespace(**{**vars(args), "capacity_tokens": capacity_tokens,
                                  "host_capacity_tokens": capacity_tokens})
    traffic = h.Traffic(small, seed)
    try:
        fleet, state_dir = durable_fleet(small, logs, ports)
        traffic.burst(fleet.urls, args.before)
        h.settle(fleet, traffic, time.time(), small)
        fleet.server.term()
        older = os.path.join(logs, "state-older")
        shutil.copytree(state_dir, older, ignore=shutil.ignore_patterns("LOCK"))
        fleet.server.start()
        wait_ready(admin)
        traffic.burst(fleet.urls, args.before)
        newer = h.settle(fleet, traffic, time.time(), small)
        fleet.server.term()
        shutil.rmtree(state_dir)
        shutil.copytree(older, state_dir)
        fleet.server.start()
        to_serving = wait_ready(admin)
        served = time.time()
        over_at_start = fleet.over_claimed(traffic)
        h.wait_until(lambda: fleet.over_claimed(traffic) == 0, "no over-claim", timeout=30, interval=0.05)
        over_zero_s = time.time() - served
        settled = h.settle(fleet, traffic, time.time(), small)
        return dict(before=newer["expected"], over_at_start=over_at_start, over_zero_s=over_zero_s,
                    to_serving=to_serving, over=settled["over"], under=settled["under"],
                    digest=h.admin_state(admin)["digest"])
    finally:
        h.stop_all()


def worker_gone_report(g):
    line = (f"TTL {g['ttl_s']} s; the dead worker's placements {g['phantom_at_kill']} at the kill, "
            f"0 after {g['purged_after']:.1f} s; {g['phantom_after_restart']} after a restart; the live worker: "
            f"over {g['over']}, under {g['under']}")
    return line, bool(g["over"] or g["under"] or g["phantom_after_restart"] or not g["phantom_at_kill"])


def older_state_report(o):
    line = (f"the server restarted on an older copy of its state directory: serving after "
            f"{o['to_serving']:.2f} s with {o['over_at_start']} over-claimed placements, 0 after "
            f"{o['over_zero_s']:.2f} s; settled: over {o['over']}, under {o['under']} of {o['before']}")
    return line, bool(o["over"]) or not o["over_at_start"]


# Cases with a report of their own: (name, run, report -> (line, failed)).
SPECIAL_CASES = [("worker-gone", worker_gone, worker_gone_report),
                 ("older-state", older_state, older_state_report)]


def routing_window(args, fleet, traffic, router_url, admin):
    """Requests through the router while the server is killed and restarted: decisions by reason."""
    def fault(_load):
        fleet.server.restart(down_s=args.down_s)
        wait_ready(admin)

    _, window, decisions, _ = h.routing_window(router_url, traffic, fault)
    blind = sum(h.blind_decisions(decisions).values())
    return dict(routed=sum(decisions.values()), blind=blind, window_s=window, decisions=decisions)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join([*CASES, "worker-gone", "older-state"]),
                    help="comma-separated cases: " + ", ".join(CASES) + ", worker-gone, older-state")
    h.add_fleet_args(ap, workers=2, base_port=27600, docs=24, capacity_tokens=1 << 20,
                     host_capacity_tokens=1 << 20, stable_s=3.0, deadline_s=40.0, poll_s=0.2, seed=11)
    ap.add_argument("--before", type=int, default=40)
    ap.add_argument("--after", type=int, default=0)
    ap.add_argument("--during-s", type=float, default=2.5)
    args = h.parse_args(ap, SHORT, **SHORT_DEFAULTS)
    cases = h.selected(ap, args.only, [*CASES, *(name for name, _, _ in SPECIAL_CASES)])
    h.build(args, "sgl-kv-indexer", "kv-indexer-tools", "kv-indexer-router", binaries=BINARIES)
    logs_root = tempfile.mkdtemp(prefix="kv-crash-tests-")
    rows, failed = [], False
    for name, run, report in SPECIAL_CASES:
        if name not in cases:
            continue
        cases.remove(name)
        try:
            line, bad = report(run(args, logs_root, args.seed))
            print(f"{name}: {line}", file=sys.stderr)
            failed |= bad
        except Exception as error:
            print(f"  {name} failed: {error}", file=sys.stderr)
            failed = True
    case_rows, case_failed = h.run_cases(cases, lambda name: CASES[name][3],
                                         lambda name, k: run_case(args, name, logs_root, args.seed + k))
    rows += case_rows
    failed |= case_failed
    for name, r in case_rows:
        if r is None:
            continue
        if r["over"] or (r["under"] and not r["under_ok"]) or not r["digest_equal"]:
            failed = True
        print(f"  {name}: files at the fault: {r['files']}; decisions in the window: {r['decisions']}",
              file=sys.stderr)
    print()
    print(f"{'case':<16} {'description':<38} {'before':>7} {'after':>7} {'over':>5} {'under':>6} "
          f"{'digest':>7} {'serving_s':>9} {'disk_B/pl':>9} {'routed':>7} {'blind':>6} {'window_s':>8}")
    for name, r in rows:
        desc = CASES[name][3]
        if r is None:
            print(f"{name:<16} {desc:<38} {'ERROR':>7}")
            continue
        digest = "equal" if r["digest_equal"] else "DIFFERS"
        per = r["disk_bytes"] / max(r["before"], 1)
        print(f"{name:<16} {desc:<38} {r['before']:>7} {r['after']:>7} {r['over']:>5} {r['under']:>6} "
              f"{digest:>7} {r['to_serving']:>9.3f} {per:>9.1f} {r['routed']:>7} {r['blind']:>6} {r['window_s']:>8.2f}")
    print(f"\nlogs: {logs_root}")
    return 1 if failed else 0


if __name__ == "__main__":
    h.run_main(main)
