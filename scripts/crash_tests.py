#!/usr/bin/env python3
"""Crash tests of the durable Indexer with real processes on loopback: after the server dies
and restarts on its state directory, does the index hold exactly what every worker holds?

Fleet (from fault_tests.py): the Indexer with KV_INDEXER_STATE_DIR, --workers simulated SGLang
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

    scripts/crash_tests.py [--only kill9-batch,sigterm] [--workers 2] [--base-port 47600]

Exit status 1 when a case over-claims, under-claims where it must not, or changes the digest.
Only the Python standard library; the binaries are built with cargo (release) unless --no-build.
"""

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_tests as ft  # noqa: E402  (the fleet, traffic and views are shared)

CASES = {
    # name: (server flags, the fault, under-claims allowed, description)
    "kill9-batch": (["--log-sync", "batch"], "kill", False, "kill -9, --log-sync batch"),
    "kill9-always": (["--log-sync", "always"], "kill", False, "kill -9, --log-sync always"),
    "sigterm": (["--log-sync", "batch"], "term", False, "SIGTERM (final snapshot), restart"),
    "kill9-snapshot": (["--log-sync", "batch", "--snapshot-interval-s", "1"], "kill-in-snapshot", False,
                       "kill -9 as a snapshot is being built"),
    "kill9-sync-off": (["--log-sync", "off"], "kill", True, "kill -9, --log-sync off"),
}


def state(admin):
    import json
    with urllib.request.urlopen(f"http://{admin}/state", timeout=10) as r:
        return json.loads(r.read())


def router_decisions(url):
    """{reason: count} from the router's kv_router_decisions_total."""
    counts = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kv_router_decisions_total{"):
                labels, value = line.rsplit(" ", 1)
                reason = labels.split('reason="', 1)[1].split('"', 1)[0]
                counts[reason] = counts.get(reason, 0) + int(float(value))
    return counts


# Decisions made on the Indexer's signal: a confirmed or predicted match, or an answer that no
# worker holds the prompt. Every other reason is blind (the Indexer gave no signal).
HIT_REASONS = ("cache_hit", "predicted_hit")
INFORMED_REASONS = (*HIT_REASONS, "no_usable_match")


def blind_decisions(decisions):
    """The decisions the Indexer gave no signal for, by reason."""
    return {k: v for k, v in decisions.items() if k not in INFORMED_REASONS}


def hit_decisions(decisions):
    """Decisions routed on a match (confirmed or predicted)."""
    return sum(decisions.get(k, 0) for k in HIT_REASONS)


def diff(after, before):
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before) if after.get(k, 0) != before.get(k, 0)}


def wait_ready(admin, timeout=60.0):
    start = time.time()

    def ready():
        try:
            return state(admin)["ready"]
        except Exception:
            return False

    ft.wait_until(ready, "the restarted server to be SERVING", timeout=timeout, interval=0.01)
    return time.time() - start


def kill_in_snapshot(fleet, state_dir, timeout=30.0):
    """kill -9 the server right after a snapshot starts (a new log segment appears)."""
    def segments():
        return {n for n in os.listdir(state_dir) if n.endswith(".seg")}

    known = segments()
    deadline = time.time() + timeout
    while time.time() < deadline:
        now = segments()
        if now - known:
            fleet.server.popen.send_signal(signal.SIGKILL)
            fleet.server.popen.wait(timeout=10)
            return sorted(os.listdir(state_dir))
        time.sleep(0.0005)
    raise RuntimeError("no snapshot started")


def run_case(args, name, logs_root, seed):
    flags, fault, under_ok, _ = CASES[name]
    logs = os.path.join(logs_root, name)
    os.makedirs(logs)
    state_dir = os.path.join(logs, "state")
    admin = f"{ft.HOST}:{args.base_port + 1}"
    server_extra = ["--state-dir", state_dir, "--metrics-addr", admin, *flags]
    fleet = ft.Fleet(args, logs, server_extra=server_extra)
    router_port = args.base_port + 2
    router_url = f"http://{ft.HOST}:{router_port}"
    router = ft.Proc(logs, "router", [f"{ft.BIN}/kv-indexer-router", "--listen-addr", f"{ft.HOST}:{router_port}",
                                      "--worker-urls", ",".join(fleet.urls), "--kv-indexer-endpoint", fleet.endpoint,
                                      "--cache-affinity-min-matched-tokens", "16"])
    ft.wait_until(lambda: ft.http_ok(f"{router_url}/health"), "the router")
    traffic = ft.Traffic(args, seed)
    try:
        traffic.burst(fleet.urls, args.before)
        stop, thread = traffic.background(fleet.urls)
        time.sleep(args.during_s)
        stop.set()
        thread.join(timeout=60)
        settled = ft.settle(fleet, traffic, time.time(), args)
        if settled["over"] or settled["under"]:
            raise RuntimeError(f"the index did not match the workers before the fault: {settled}")
        before = state(admin)
        if fault == "kill":
            fleet.server.kill9()
        elif fault == "kill-in-snapshot":
            # Quiet now, but the bridges' heartbeats are records too: the next one starts a
            # snapshot (every second while the log grows), and the kill lands in it.
            files = kill_in_snapshot(fleet, state_dir)
        else:
            fleet.server.popen.send_signal(signal.SIGTERM)
            fleet.server.popen.wait(timeout=30)
        if fault != "kill-in-snapshot":
            files = sorted(os.listdir(state_dir))
        placements_before = settled["expected"]
        fleet.server.start()
        to_serving = wait_ready(admin)
        after = state(admin)
        workers = fleet.worker_views()
        universe = traffic.universe | {h for v in workers.values() for _, h in v}
        index = fleet.index_view(universe)
        expected, held, over, under, examples = ft.compare(workers, index)
        result = dict(before=placements_before, after=held, over=over, under=under, to_serving=to_serving,
                      digest_equal=(before is None or before["digest"] == after["digest"]),
                      files=" ".join(f for f in files if not f.startswith("LOCK")),
                      disk_bytes=sum(os.path.getsize(os.path.join(state_dir, f)) for f in os.listdir(state_dir)),
                      examples=examples, under_ok=under_ok)
        result.update(routing_window(args, fleet, traffic, router_url, admin))
        return result
    finally:
        ft.stop_all()


def worker_gone(args, logs_root, seed, ttl_s=3):
    """A worker and its bridge killed for good: its placements must go after the TTL and a
    sweep (0 phantom placements), the other worker's stay exact, and a restart agrees."""
    logs = os.path.join(logs_root, "worker-gone")
    os.makedirs(logs)
    state_dir = os.path.join(logs, "state")
    admin = f"{ft.HOST}:{args.base_port + 1}"
    fleet = ft.Fleet(args, logs, server_extra=["--state-dir", state_dir, "--metrics-addr", admin,
                                               "--worker-ttl-s", str(ttl_s)])
    traffic = ft.Traffic(args, seed)
    try:
        traffic.burst(fleet.urls, args.before)
        settled = ft.settle(fleet, traffic, time.time(), args)
        if settled["over"] or settled["under"]:
            raise RuntimeError(f"the index did not match the workers before the fault: {settled}")
        gone, alive = fleet.ids[-1], fleet.ids[:-1]
        views = fleet.worker_views()
        universe = traffic.universe | {h for v in views.values() for _, h in v}
        phantom_at_kill = len(fleet.index_view(universe).get(gone, set()))
        fleet.bridges[-1].kill9()
        fleet.sims[-1].kill9()
        killed = time.time()

        def phantoms():
            return len(fleet.index_view(universe).get(gone, set()))

        ft.wait_until(lambda: phantoms() == 0, "the dead worker's placements to go", timeout=ttl_s + 30, interval=0.1)
        purged_after = time.time() - killed
        live_views = {w: v for w, v in views.items() if w in alive}
        index = fleet.index_view(universe)
        _, _, over, under, _ = ft.compare(live_views, {w: v for w, v in index.items() if w in alive})
        fleet.server.kill9()
        fleet.server.start()
        wait_ready(admin)
        phantom_after_restart = phantoms()
        return dict(phantom_at_kill=phantom_at_kill, purged_after=purged_after, over=over, under=under,
                    phantom_after_restart=phantom_after_restart, ttl_s=ttl_s)
    finally:
        ft.stop_all()


def older_state(args, logs_root, seed, capacity_tokens=4096):
    """The server restarted on an older copy of its state directory (a restored volume
    snapshot): it claims what the workers dropped since, and its bridges were told those
    batches were applied. Their next numbered apply shows the gap; the worker is cleared and
    re-synced from its publisher's buffer. Small caches, so the workers evict (drop) blocks."""
    logs = os.path.join(logs_root, "older-state")
    os.makedirs(logs)
    state_dir = os.path.join(logs, "state")
    admin = f"{ft.HOST}:{args.base_port + 1}"
    small = argparse.Namespace(**{**vars(args), "capacity_tokens": capacity_tokens,
                                  "host_capacity_tokens": capacity_tokens})
    fleet = ft.Fleet(small, logs, server_extra=["--state-dir", state_dir, "--metrics-addr", admin])
    traffic = ft.Traffic(small, seed)
    try:
        traffic.burst(fleet.urls, args.before)
        ft.settle(fleet, traffic, time.time(), small)
        fleet.server.popen.send_signal(signal.SIGTERM)
        fleet.server.popen.wait(timeout=30)
        older = os.path.join(logs, "state-older")
        shutil.copytree(state_dir, older, ignore=shutil.ignore_patterns("LOCK"))
        fleet.server.start()
        wait_ready(admin)
        traffic.burst(fleet.urls, args.before)
        newer = ft.settle(fleet, traffic, time.time(), small)
        fleet.server.popen.send_signal(signal.SIGTERM)
        fleet.server.popen.wait(timeout=30)
        shutil.rmtree(state_dir)
        shutil.copytree(older, state_dir)
        fleet.server.start()
        to_serving = wait_ready(admin)
        served = time.time()
        over_at_start = fleet.over_claimed(traffic)
        ft.wait_until(lambda: fleet.over_claimed(traffic) == 0, "no over-claim", timeout=30, interval=0.05)
        over_zero_s = time.time() - served
        settled = ft.settle(fleet, traffic, time.time(), small)
        return dict(before=newer["expected"], over_at_start=over_at_start, over_zero_s=over_zero_s,
                    to_serving=to_serving, over=settled["over"], under=settled["under"],
                    digest=state(admin)["digest"])
    finally:
        ft.stop_all()


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
    before = router_decisions(router_url)
    stop = threading.Event()
    sent = [0]

    def loop():
        while not stop.is_set():
            try:
                traffic.one(router_url)
                sent[0] += 1
            except Exception:
                pass

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(4)]
    for w in workers:
        w.start()
    time.sleep(1.0)
    fleet.server.kill9()
    down_at = time.time()
    time.sleep(args.down_s)
    fleet.server.start()
    wait_ready(admin)
    window = time.time() - down_at
    time.sleep(1.0)
    stop.set()
    for w in workers:
        w.join(timeout=30)
    decisions = diff(router_decisions(router_url), before)
    blind = sum(blind_decisions(decisions).values())
    return dict(routed=sum(decisions.values()), blind=blind, window_s=window, decisions=decisions)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join([*CASES, "worker-gone", "older-state"]),
                    help="comma-separated cases: " + ", ".join(CASES) + ", worker-gone, older-state")
    ft.add_fleet_args(ap, workers=2, base_port=47600, docs=24, capacity_tokens=1 << 20,
                      host_capacity_tokens=1 << 20, stable_s=3.0, deadline_s=40.0, poll_s=0.2, seed=11)
    ap.add_argument("--before", type=int, default=40)
    ap.add_argument("--after", type=int, default=0)
    ap.add_argument("--during-s", type=float, default=2.5)
    args = ap.parse_args()
    cases = ft.selected(ap, args.only, [*CASES, *(name for name, _, _ in SPECIAL_CASES)])
    ft.build(args, "sgl-kv-indexer", "kv-indexer-tools", "kv-indexer-router")
    logs_root = tempfile.mkdtemp(prefix="kv-crash-tests-")
    signal.signal(signal.SIGTERM, lambda s, _f: (ft.stop_all(), sys.exit(128 + s)))
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
    case_rows, case_failed = ft.run_cases(cases, lambda name: CASES[name][3],
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
    try:
        sys.exit(main())
    finally:
        ft.stop_all()
