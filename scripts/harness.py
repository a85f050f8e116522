"""The plumbing of the fault suites (fault_tests.py, crash_tests.py, fleet_tests.py and
compose_tests.py; the benchmarks borrow pieces): real processes on loopback, started, killed
and stopped by pid; the ports they listen on; the directory of the binaries and building them;
waiting; the fleet of Indexer server(s), simulated SGLang workers and their bridges; the
router and what it decided; a real redis-server with its replicas and sentinels; traffic; and
polling the index against every worker's own cache view.

A new fault case is a few lines:

    fleet = harness.Fleet(args, logs)            # the server, --workers sims, a bridge each
    traffic = harness.Traffic(args, seed)
    traffic.burst(fleet.urls, 20)
    fleet.server.kill9()                         # the fault
    fleet.server.start()
    result = harness.settle(fleet, traffic, time.time(), args)   # over- and under-claims

with `args` from an ArgumentParser given add_fleet_args (and parse_args for --short), and the
script's main run by run_main, which stops every process started whatever happens. Only the
Python standard library.
"""

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "127.0.0.1"
PAGE = 16
TIERS = {"GPU": "HBM", "CPU_PINNED": "DRAM"}  # the worker's tier names -> the index's
MAX_MATCH_HASHES = 16384


# -- the binaries ----------------------------------------------------------------------------------

def default_bin_dir():
    """The release directory of the cargo target ($CARGO_TARGET_DIR, else target/)."""
    return os.path.join(os.path.abspath(os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")),
                        "release")


BIN = default_bin_dir()


def set_bin_dir(path):
    global BIN
    BIN = os.path.abspath(path)


def binary(name):
    """The path of binary `name` in the directory chosen now (--bin-dir)."""
    return os.path.join(BIN, name)


def build(args, *packages, binaries=()):
    """Takes the binaries from --bin-dir when `args` has it, builds `packages` there with cargo
    unless --no-build (the dev profile for a directory named debug, else release), then checks
    that each of `binaries` is there."""
    if getattr(args, "bin_dir", None):
        set_bin_dir(args.bin_dir)
    if not args.no_build:
        profile = os.path.basename(BIN)
        if profile not in ("debug", "release"):
            sys.exit(f"cannot build into {BIN} (not a cargo target's debug or release directory): pass --no-build")
        argv = ["cargo", "build", "-q", "--target-dir", os.path.dirname(BIN)]
        if profile == "release":
            argv.append("--release")
        for package in packages:
            argv += ["-p", package]
        subprocess.run(argv, cwd=ROOT, check=True)
    missing = [name for name in binaries if not os.access(binary(name), os.X_OK)]
    if missing:
        sys.exit(f"missing in {BIN}: {', '.join(missing)} (build them, or drop --no-build)")


# -- processes -------------------------------------------------------------------------------------

# Every process started, so that any exit path stops them (by pid, never by name), and every
# Proxy open.
ALL_PROCS = []
OPEN_PROXIES = []


class Proc:
    """One binary, restartable with the same arguments; its output in logs/<name>.<start>.log."""

    def __init__(self, logs, name, argv, env=None):
        self.logs, self.name, self.argv, self.env = logs, name, argv, env
        self.popen = None
        self.starts = 0
        self.start()

    def log_path(self):
        return os.path.join(self.logs, f"{self.name}.{self.starts}.log")

    def start(self):
        self.starts += 1
        log = open(self.log_path(), "w")
        self.popen = subprocess.Popen(self.argv, stdout=log, stderr=log, env=self.env,
                                      stdin=subprocess.DEVNULL)
        log.close()
        ALL_PROCS.append(self.popen)

    def send(self, sig, timeout=30):
        """Sends `sig` and waits for the process to exit."""
        self.popen.send_signal(sig)
        self.popen.wait(timeout=timeout)

    def kill9(self):
        self.send(signal.SIGKILL, timeout=10)

    def term(self):
        self.send(signal.SIGTERM, timeout=60)

    def restart(self, sig=signal.SIGKILL, down_s=0.0):
        """`sig` (kill -9 by default), `down_s` seconds down, started again."""
        self.send(sig, timeout=60)
        time.sleep(down_s)
        self.start()

    def alive(self):
        return self.popen.poll() is None

    def tail(self, lines=4):
        """The last non-empty lines of the current log, joined."""
        with open(self.log_path(), errors="replace") as f:
            kept = [line.rstrip() for line in f if line.strip()]
        return " | ".join(kept[-lines:])


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
    """Stops every process started, and closes every Proxy."""
    stop(ALL_PROCS)
    ALL_PROCS.clear()
    while OPEN_PROXIES:
        OPEN_PROXIES.pop().close()


def run_main(main):
    """Exits with `main()`'s status, stopping every process the run started whatever happens
    (SIGTERM and SIGINT too)."""
    def on_signal(signum, _frame):
        stop_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        sys.exit(main())
    finally:
        stop_all()


class Ports:
    """The ports of one fleet by role and index: --base-port plus the role's offset (the
    layout below), or with base 0 a port the kernel says is free now, kept for the run (a
    restarted process gets its port back). The suites' bases lie below the kernel's ephemeral
    range (32768-60999 by default): there, a client's connection in TIME_WAIT can hold a port a
    fleet is about to listen on."""

    OFFSETS = {  # role: the offset of index k
        "server": lambda k: 0 if k == 0 else 300 + k,  # replica k of the Indexer
        "admin": lambda k: 1 if k == 0 else 400 + k,  # its --metrics-addr (/state, /metrics)
        "router": lambda k: 2,  # one of each of these
        "redis": lambda k: 5,
        "proxy": lambda k: 6,
        "redis-replica": lambda k: 7 + k,
        "sentinel": lambda k: 50 + k,
        "sim": lambda k: 10 + k,  # worker k's HTTP
        "events": lambda k: 100 + k,  # its KV events publisher
        "replay": lambda k: 200 + k,  # its replay endpoint
    }

    def __init__(self, base):
        self.base = base
        self.free = {}

    def __call__(self, role, k=0):
        if self.base:
            return self.base + self.OFFSETS[role](k)
        if (role, k) not in self.free:
            with socket.socket() as s:
                s.bind((HOST, 0))
                self.free[(role, k)] = s.getsockname()[1]
        return self.free[(role, k)]

    def addr(self, role, k=0):
        return f"{HOST}:{self(role, k)}"

    def url(self, role, k=0):
        return f"http://{self.addr(role, k)}"


# -- waiting and HTTP ------------------------------------------------------------------------------

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


def tcp_open(port):
    with socket.create_connection((HOST, port), timeout=0.5):
        return True


def rss_mib(pid):
    """The resident memory (VmRSS) of process `pid`, in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def admin_state(addr):
    """GET /state on a server's admin address (host:port)."""
    return http_json(f"http://{addr}/state")


def wait_state(addr, key, what, timeout=60.0):
    """Waits until /state on `addr` says `key` (ready, fresh); returns the seconds it took."""
    start = time.time()
    wait_until(lambda: admin_state(addr)[key], what, timeout=timeout, interval=0.01)
    return time.time() - start


# -- options ---------------------------------------------------------------------------------------

# The options Fleet, Traffic and settle read, shared by the scripts that run a fleet: (flag, type,
# default where most scripts agree, help).
FLEET_OPTIONS = [
    ("--workers", int, None, None),
    ("--base-port", int, None, "the first port (0: free ports)"),
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
    """Adds FLEET_OPTIONS, --no-build and --bin-dir to `ap`; `defaults` (base_port=27300, ...)
    gives the script's own default for an option, and must for those without a shared one."""
    for flag, kind, default, help in FLEET_OPTIONS:
        ap.add_argument(flag, type=kind, default=defaults.pop(flag[2:].replace("-", "_"), default), help=help)
    if defaults:
        raise TypeError(f"not fleet options: {sorted(defaults)}")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--bin-dir", default=BIN, help="the binaries' directory (default: %(default)s)")


def parse_args(ap, short_cases, **short_defaults):
    """`ap`'s arguments, with --short: only `short_cases` (unless --only) and `short_defaults`
    as the defaults of their options (a flag given still wins)."""
    ap.add_argument("--short", action="store_true",
                    help=f"the short run (CI): {','.join(short_cases)}, less traffic")
    args = ap.parse_args()
    if args.short:
        ap.set_defaults(only=",".join(short_cases), **short_defaults)
        args = ap.parse_args()
    return args


def selected(ap, only, known, what="case"):
    """The comma-separated names of `only`, each one of `known` (else `ap` exits naming it)."""
    names = [name for name in only.split(",") if name]
    for name in names:
        if name not in known:
            ap.error(f"unknown {what} {name!r}")
    return names


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
        finally:
            stop_all()  # whatever the case left, before the next takes its ports
    return rows, failed


# -- the fleet -------------------------------------------------------------------------------------

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


class Fleet:
    """The Indexer (or `replicas` of it, with `replica_extra(k)`'s flags), --workers simulated
    workers and a bridge each, whose KV_INDEXER_ENDPOINT lists every replica; on `ports`
    (default: from --base-port)."""

    def __init__(self, args, logs, sim_extra=(), replay=True, server_extra=(), replicas=1,
                 replica_extra=lambda k: [], ports=None):
        self.args, self.logs = args, logs
        self.ports = ports or Ports(args.base_port)
        self.endpoints = [self.ports.url("server", k) for k in range(replicas)]
        self.endpoint = self.endpoints[0]
        self.servers = [self.start_server(k, [*server_extra, *replica_extra(k)]) for k in range(replicas)]
        self.server = self.servers[0]
        self.sims, self.bridges, self.urls, self.ids = [], [], [], []
        for i in range(args.workers):
            self.start_worker(i, sim_extra, replay)
        for k in range(replicas):
            wait_until(lambda: tcp_open(self.ports("server", k)), "the server")
        for url in self.urls:
            wait_until(lambda: http_ok(f"{url}/health"), f"{url}")
        time.sleep(1.0)  # bridges subscribe (and replay from seq 0)
        self.check_alive()

    def start_server(self, k, flags):
        """Replica k of the Indexer (k = 0: the server)."""
        return Proc(self.logs, "server" if k == 0 else f"server-{k}",
                    [binary("kv-indexer-server"), "--listen-addr", self.ports.addr("server", k), *flags])

    def start_worker(self, i, sim_extra, replay):
        """Simulated worker i and its bridge."""
        args, ports = self.args, self.ports
        argv = [binary("kv-indexer-sim"), "--host", HOST, "--port", str(ports("sim", i)),
                "--kv-events-host", HOST, "--kv-events-port", str(ports("events", i)),
                "--page-size", str(PAGE), "--capacity-tokens", str(args.capacity_tokens),
                "--host-capacity-tokens", str(args.host_capacity_tokens),
                "--prefill-us-per-token", "1", "--decode-us-per-token", "100", *sim_extra]
        if replay:
            argv += ["--replay-port", str(ports("replay", i))]
        self.sims.append(Proc(self.logs, f"sim-{i}", argv))
        env = dict(os.environ, KV_INDEXER_WORKER_ID=f"sim-{i}", KV_INDEXER_WORKER_ADDRESS=ports.url("sim", i),
                   SGLANG_KV_EVENT_ENDPOINT=f"tcp://{ports.addr('events', i)}",
                   SGLANG_KV_EVENT_TOPIC="kv-events", KV_INDEXER_ENDPOINT=",".join(self.endpoints),
                   RUST_LOG="info")
        env.pop("SGLANG_KV_REPLAY_ENDPOINT", None)
        if replay:
            env["SGLANG_KV_REPLAY_ENDPOINT"] = f"tcp://{ports.addr('replay', i)}"
        self.bridges.append(Proc(self.logs, f"bridge-{i}", [binary("kv-indexer-bridge")], env))
        self.urls.append(ports.url("sim", i))
        self.ids.append(f"sim-{i}")

    def exited_bridges(self):
        """The bridges that exited on their own, with their exit status and last log lines."""
        return [f"{p.name} exited with {p.popen.returncode}: {p.tail()}" for p in self.bridges if not p.alive()]

    def check_alive(self):
        for p in [*self.servers, *self.sims, *self.bridges]:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}; see {self.logs}")

    def restart_server(self):
        self.server.restart(down_s=self.args.down_s)
        wait_until(lambda: tcp_open(self.ports("server")), "the restarted server")

    def restart_bridge(self, i):
        self.bridges[i].restart(down_s=self.args.down_s)
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

    def match(self, endpoint, hashes):
        """`kv-indexer-ctl match --json` of `hashes` at `endpoint`: its output."""
        out = subprocess.run([binary("kv-indexer-ctl"), "--endpoint", endpoint, "--json", "match", "--",
                              *map(str, hashes)], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"kv-indexer-ctl match failed: {out.stdout} {out.stderr}")
        return out.stdout

    def index_view(self, universe, endpoint=None):
        """{worker_id: set((tier, hash))} as the index (at `endpoint`, default the first
        replica) holds them, over `universe`."""
        held = {}
        hashes = sorted(universe)
        for start in range(0, len(hashes), MAX_MATCH_HASHES):
            out = self.match(endpoint or self.endpoint, hashes[start:start + MAX_MATCH_HASHES])
            for node in json.loads(out)["matches"]:
                dest = held.setdefault(node["worker_id"], set())
                for tier in node["tiers"]:
                    dest.update((tier["tier"], h) for h in tier["hashes"])
        return held

    def check(self, traffic, endpoint=None):
        """compare() of the index (at `endpoint`, default the first replica) with the workers'
        views now, over every hash `traffic` could have stored."""
        workers = self.worker_views()
        return compare(workers, self.index_view(universe(traffic, workers), endpoint))

    def over_claimed(self, traffic, endpoint=None):
        """Placements the index (at `endpoint`) claims that no worker holds now."""
        return self.check(traffic, endpoint)[2]


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


def universe(traffic, workers):
    """Every hash `traffic` could have stored, and every hash in the `workers`' views."""
    return traffic.universe | {h for view in workers.values() for _, h in view}


def compare(workers, index):
    """(expected, held, over-claimed, under-claimed, over-claim examples) of the index's
    placements against the workers' views."""
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
        index = fleet.index_view(universe(traffic, workers))
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


def settle_exactly(fleet, traffic, args):
    """settle(), which must end with the index equal to the workers (before a fault)."""
    settled = settle(fleet, traffic, time.time(), args)
    if settled["over"] or settled["under"]:
        raise RuntimeError(f"the index did not match the workers before the fault: {settled}")
    return settled


class ReplicaViews:
    """Every replica's GET /state, for a class with `replicas` (how many) and `state(k)`."""

    def fresh(self, k):
        try:
            return self.state(k).get("fresh", False)
        except Exception:
            return False

    def wait_fresh(self, k, timeout=60.0):
        """Waits until replica k serves; returns the seconds it took."""
        start = time.time()
        wait_until(lambda: self.fresh(k), f"replica {k} to serve", timeout=timeout, interval=0.01)
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
        wait_until(equal_and_stable, "every replica's digest to be equal", timeout=timeout, interval=0.1)


# -- the router ------------------------------------------------------------------------------------

def start_router(logs, ports, worker_urls, endpoints):
    """kv-indexer-router on ports("router") over `worker_urls` and the Indexer `endpoints`;
    returns it and its URL once it answers /health."""
    router = Proc(logs, "router", [binary("kv-indexer-router"), "--listen-addr", ports.addr("router"),
                                   "--worker-urls", ",".join(worker_urls),
                                   "--kv-indexer-endpoint", ",".join(endpoints),
                                   "--cache-affinity-min-matched-tokens", "16"])
    url = ports.url("router")
    wait_until(lambda: http_ok(f"{url}/health"), "the router")
    return router, url


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


class RouterLoad:
    """`threads` senders of `traffic` through the router at `url` until stopped, idle while
    `paused` is set."""

    def __init__(self, url, traffic, threads=4):
        self.url, self.traffic = url, traffic
        self.stopped, self.paused = threading.Event(), threading.Event()
        self.before = router_decisions(url)
        self.errors_before = traffic.errors
        self.threads = [threading.Thread(target=self.loop, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def loop(self):
        while not self.stopped.is_set():
            if self.paused.is_set():
                time.sleep(0.01)
                continue
            self.traffic.one(self.url)

    def stop(self):
        """Stops; returns (the router's decisions since the start by reason, failed requests)."""
        self.stopped.set()
        for t in self.threads:
            t.join(timeout=30)
        return diff(router_decisions(self.url), self.before), self.traffic.errors - self.errors_before


def routing_window(url, traffic, fault, threads=4):
    """Runs `fault(load)` while RouterLoad's `threads` senders go through the router at `url`,
    from 1 s before it until 1 s after; returns (what `fault` returned, the seconds it took,
    the router's decisions in the window by reason, the requests that failed)."""
    load = RouterLoad(url, traffic, threads)
    try:
        time.sleep(1.0)
        started = time.time()
        result = fault(load)
        took = time.time() - started
        time.sleep(1.0)
    finally:
        decisions, failed = load.stop()
    return result, took, decisions, failed


# -- Redis -----------------------------------------------------------------------------------------

def require_redis(ap):
    """Exits (through `ap`) when redis-server is missing: a suite that needs it fails, in CI
    and out, rather than skip."""
    if not shutil.which("redis-server"):
        ap.error("redis-server is not installed: run scripts/install_redis.sh")


def redis_command(port, *args, timeout=10):
    """Sends one command (RESP) and returns the first line of the answer."""
    payload = f"*{len(args)}\r\n" + "".join(f"${len(str(a).encode())}\r\n{a}\r\n" for a in args)
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(payload.encode())
        return sock.makefile("rb").readline().decode().strip()


def wait_redis(port, what):
    wait_until(lambda: redis_command(port, "PING") == "+PONG", what)


def redis_argv(port, data_dir, appendonly=False, replicaof=None):
    """A redis-server on `port` keeping its files in `data_dir`: no RDB saves, the append-only
    file when `appendonly`, a replica of the one on port `replicaof` when given."""
    argv = ["redis-server", "--bind", HOST, "--port", str(port), "--save", "",
            "--appendonly", "yes" if appendonly else "no", "--appendfsync", "everysec",
            "--dir", data_dir, "--protected-mode", "no", "--repl-diskless-sync-delay", "0"]
    return argv + (["--replicaof", HOST, str(replicaof)] if replicaof else [])


def start_redis(logs, name, port, appendonly=False, replicaof=None, data_dir=None):
    """redis_argv's redis-server as `name` (its files in `data_dir`, default logs/name), once
    it answers PING."""
    data_dir = data_dir or os.path.join(logs, name)
    os.makedirs(data_dir, exist_ok=True)
    proc = Proc(logs, name, redis_argv(port, data_dir, appendonly, replicaof))
    wait_redis(port, name)
    return proc


def start_sentinels(logs, ports, primary_port, master="mymaster"):
    """Sentinels on `ports` watching the primary on `primary_port` (quorum 2, down after 1 s)."""
    for i, port in enumerate(ports):
        conf = os.path.join(logs, f"sentinel-{i}.conf")
        with open(conf, "w") as f:
            f.write(f"port {port}\nbind {HOST}\ndir {logs}\n"
                    f"sentinel monitor {master} {HOST} {primary_port} 2\n"
                    f"sentinel down-after-milliseconds {master} 1000\n"
                    f"sentinel failover-timeout {master} 5000\n")
        Proc(logs, f"sentinel-{i}", ["redis-server", conf, "--sentinel"])
        wait_redis(port, f"sentinel {i}")


def sentinel_master_port(port, master="mymaster"):
    """The port of the primary the sentinel on `port` names now (None when it names none)."""
    payload = f"*3\r\n$8\r\nSENTINEL\r\n$23\r\nget-master-addr-by-name\r\n${len(master)}\r\n{master}\r\n"
    with socket.create_connection((HOST, port), timeout=5) as sock:
        sock.sendall(payload.encode())
        reply = sock.makefile("rb")
        if reply.readline().strip() != b"*2":
            return None
        lines = [reply.readline().strip() for _ in range(4)]
        return int(lines[3])


class Proxy:
    """A TCP proxy (to Redis) that can stop forwarding: clear `flowing` for a partition (the
    connections stay open, nothing arrives either way), set it to heal."""

    def __init__(self, listen_port, target_port):
        self.target = target_port
        self.flowing = threading.Event()
        self.flowing.set()
        self.sockets = []
        self.server = socket.create_server((HOST, listen_port))
        OPEN_PROXIES.append(self)
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection((HOST, self.target), timeout=5)
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
