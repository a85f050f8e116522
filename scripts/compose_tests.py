#!/usr/bin/env python3
"""The fleet of deploy/compose/ in real containers: Redis (AOF on), two Indexer replicas on
its stream, three simulated SGLang workers each with its bridge, and the router, each in its
own container, from the image scripts/build_image.sh makes.

Brings the compose project up under a unique name (docker-compose.yml plus
docker-compose.test.yml, which publishes the replicas' /state and the workers' /cache_view on
the host's loopback), runs the cases, prints a row per case, saves every container's log and
tears the project down, whatever happened. Cases:

  rest       the fleet at rest, first: no request for --rest-settle-s, then for --rest-s Redis's
             commands (CONFIG RESETSTAT, then INFO commandstats) and every container's CPU (its
             cgroup's counter, and its server process's apart): at most 20 commands/s per
             replica (the bridges' heartbeats and the health checks' PINGs count), and
             redis-server and each replica's server at most 2 % of a core. The bound is on the
             server process because the rest of the group is Docker's health check, a `docker
             exec` every 2 s (Redis) or 5 s (replicas) costing ~1-1.5 % of a core by itself;
             where this host cannot see the containers' processes, on the whole group.
  route      requests with shared prefixes through the router: `cache_hit` decisions
             (kv_router_decisions_total and the x-routing-reason header); the index equals
             the workers' caches, and both replicas' digests are equal.
  prometheus the compose file's Prometheus, with the example configuration and the alert rules:
             after `route`'s traffic, every scrape target (2 replicas, 3 bridges, the router)
             is up, every rule has been evaluated without an error, and every metric an alert
             expression names has a live series (a renamed or never-exported metric would
             leave its alert silent forever).
  kill       `docker kill` indexer-0 (the replica routers and bridges try first) while
             requests flow through the router, `docker start` it 2 s later: no request fails,
             the bridges go on (none restarted), no replica over-claims against the workers,
             digests equal once it serves again.
  partition  `docker network disconnect` indexer-0 from Redis's network while requests flow:
             NOT_SERVING (`kv-indexer-ctl health` in the container, and /state) within
             KV_INDEXER_MAX_LAG_MS + 0.5 s, with kv_indexer_fleet_lag_seconds past the bound;
             reconnected, it serves again with the other's digest.
  redis      `docker restart` Redis (AOF on) with the fleet quiet: nothing lost, i.e. after the
             replicas serve again the digests and placement counts are those of before, and the
             index still equals the workers' caches.

    scripts/compose_tests.py [--build] [--profile dev] [--only route,kill] [--keep]

--build runs scripts/build_image.sh first (with --profile); otherwise the images must exist
(kv-indexer:latest and redis:7.0-bookworm, or those --image and --redis-image name). Exit
status 1 when any case fails. Needs a Docker Engine with `docker compose` or docker-compose;
only the Python standard library.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import re
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402  (traffic, views, settle, replicas' /state, router decisions)

ROOT = h.ROOT
COMPOSE_DIR = os.path.join(ROOT, "deploy", "compose")
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.test.yml"]
REPLICAS = ["indexer-0", "indexer-1"]
WORKERS = ["worker-0", "worker-1", "worker-2"]
BRIDGES = ["bridge-0", "bridge-1", "bridge-2"]
GRPC = "http://127.0.0.1:50051"  # a replica's own listener, from inside its container

CASES = {
    "rest": "the fleet idle: Redis commands/s, CPU",
    "route": "shared prefixes through the router: cache_hit",
    "prometheus": "every target up, every alert evaluates on live series",
    "kill": "docker kill indexer-0 mid-stream, start it",
    "partition": "indexer-0 cut off Redis (network disconnect)",
    "redis": "docker restart redis (AOF), fleet quiet",
}


def run(argv, check=True, timeout=180, env=None):
    """Runs `argv`, returns its CompletedProcess (text); raises with its output if it fails."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                         stdin=subprocess.DEVNULL)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} … exited {out.returncode}: {out.stderr.strip()[-800:]}")
    return out


def compose_command():
    """`docker compose` (the plugin) when there is one, else docker-compose (v1)."""
    if run(["docker", "compose", "version"], check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RuntimeError("neither `docker compose` nor docker-compose is installed")


class Project:
    """The compose project under a unique name, and its containers by service."""

    def __init__(self, name, args):
        self.name = name
        self.env = dict(os.environ, KV_ROUTER_PUBLISH="127.0.0.1:", KV_PROMETHEUS_PUBLISH="127.0.0.1:",
                        KV_PROMETHEUS_IMAGE=args.prometheus_image, KV_INDEXER_MAX_LAG_MS=str(args.max_lag_ms),
                        KV_SIM_CAPACITY_TOKENS="8192", KV_INDEXER_IMAGE=args.image, KV_REDIS_IMAGE=args.redis_image)
        files = [arg for f in COMPOSE_FILES for arg in ("-f", os.path.join(COMPOSE_DIR, f))]
        self.base = [*compose_command(), "-p", name, *files]
        self.ids = {}

    def compose(self, *args, timeout=300):
        return run([*self.base, *args], env=self.env, timeout=timeout)

    def up(self):
        self.compose("up", "-d", "--no-build")

    def down(self):
        run([*self.base, "down", "-v", "--remove-orphans", "-t", "5"], check=False, env=self.env, timeout=300)

    def save_logs(self, path):
        with open(path, "w") as f:
            f.write(run([*self.base, "logs", "--no-color", "-t"], check=False, env=self.env).stdout)

    def container(self, service):
        if service not in self.ids:
            out = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.name}",
                       "--filter", f"label=com.docker.compose.service={service}"]).stdout.split()
            if len(out) != 1:
                raise RuntimeError(f"{service}: {len(out)} containers")
            self.ids[service] = out[0]
        return self.ids[service]

    def network_name(self, key):
        out = run(["docker", "network", "ls", "--format", "{{.Name}}", "--filter",
                   f"label=com.docker.compose.project={self.name}",
                   "--filter", f"label=com.docker.compose.network={key}"]).stdout.split()
        if len(out) != 1:
            raise RuntimeError(f"network {key}: {len(out)} found")
        return out[0]

    def url(self, service, port):
        """http://127.0.0.1:<host port> where `service`'s `port` is published now."""
        for line in run(["docker", "port", self.container(service), f"{port}/tcp"]).stdout.splitlines():
            if line.startswith("127.0.0.1:"):
                return f"http://{line.strip()}"
        raise RuntimeError(f"{service}:{port} is not published")

    def docker(self, verb, service, *args, timeout=60):
        return run(["docker", verb, *args, self.container(service)], timeout=timeout)

    def exec(self, service, *argv, check=True, timeout=30):
        return run(["docker", "exec", self.container(service), *argv], check=check, timeout=timeout)

    def inspect(self, service):
        return json.loads(run(["docker", "inspect", self.container(service)]).stdout)[0]


class ComposeFleet(h.Fleet, h.ReplicaViews):
    """harness.py's Fleet (worker_views, index_view, over_claimed) and ReplicaViews (fresh,
    wait_fresh, digests, wait_converged), for the containers: replica k is REPLICAS[k]; the
    index is read with kv-indexer-ctl inside a replica's container, its GET /state and the
    workers' /cache_view through the ports published on the loopback."""

    def __init__(self, project):  # not Fleet's: it starts processes, and here they run
        self.project = project
        self.replicas = len(REPLICAS)
        self.ids = list(WORKERS)
        self.endpoints = list(REPLICAS)  # what over_claimed passes to index_view
        self.endpoint = REPLICAS[0]
        self.urls = [project.url(w, 30000) for w in WORKERS]
        self.router_url = project.url("router", 30080)
        self.admin = {}

    def match(self, endpoint, hashes):
        """Fleet.index_view's `kv-indexer-ctl match`, in the container of replica `endpoint`."""
        return self.project.exec(endpoint, "kv-indexer-ctl", "--endpoint", GRPC, "--json", "match", "--",
                                 *map(str, hashes)).stdout

    def state(self, k):
        """Replica k's GET /state (its host port is looked up again after a failure: a
        restarted container gets another)."""
        if k not in self.admin:
            self.admin[k] = self.project.url(REPLICAS[k], 9090)
        try:
            return h.http_json(f"{self.admin[k]}/state", timeout=2)
        except Exception:
            self.admin.pop(k, None)
            raise


# -- health ------------------------------------------------------------------------------------

def serving(project, replica):
    """`kv-indexer-ctl health` inside the replica's container: SERVING (exit 0) or not."""
    return project.exec(replica, "kv-indexer-ctl", "--endpoint", GRPC, "--timeout-ms", "1000", "health",
                        check=False).returncode == 0


# Inside the container, so that neither `docker exec` nor `docker network` delays what it
# sees: waits until the interface with the MAC $1 (the container's leg on Redis's network)
# is gone, prints the clock then (the cut), then asks `kv-indexer-ctl health` every 20 ms and
# prints when the first call answering other than SERVING began and ended. The host shares
# the clock.
WATCH_CUT = f"""
for i in /sys/class/net/*; do [ "$(cat $i/address)" = "$1" ] && leg=$i; done
[ -n "$leg" ] || {{ echo "no interface with address $1" >&2; exit 3; }}
echo ready
while [ -e "$leg" ]; do sleep 0.002; done
date +%s.%N
while began=$(date +%s.%N); kv-indexer-ctl --endpoint {GRPC} --timeout-ms 1000 health >/dev/null 2>&1; do
  sleep 0.02
done
echo "$began $(date +%s.%N)"
"""


class CutWatch:
    """WATCH_CUT running in the replica's container: when its leg on `network` went, and
    when the health check that first saw something other than SERVING began and ended."""

    def __init__(self, project, replica, network):
        mac = project.inspect(replica)["NetworkSettings"]["Networks"][network]["MacAddress"]
        self.proc = subprocess.Popen(["docker", "exec", project.container(replica), "bash", "-c", WATCH_CUT,
                                      "watch", mac], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the watch in {replica} did not start: {self.proc.stderr.read()}")

    def times(self, timeout=10):
        """(the cut, (began, ended) of the first check not SERVING), as time.time() reads."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        times = [float(t) for t in out.split()]
        if len(times) != 3:
            raise RuntimeError(f"the watch saw {out.split()} ({err.strip()})")
        return times[0], (times[1], times[2])


def wait_started(project, fleet):
    """Every replica serving, every container with a health check healthy."""
    fleet.wait_all_fresh()

    def healthy(service):
        return project.inspect(service)["State"].get("Health", {}).get("Status") == "healthy"

    for service in [*WORKERS, *BRIDGES, "router"]:
        h.wait_until(lambda: healthy(service), f"{service} to be healthy", timeout=120, interval=0.5)
    time.sleep(1.0)  # the bridges subscribe (and replay from seq 0)


def restarts(project, services):
    """{service: restart count} of those that restarted or stopped."""
    out = {}
    for service in services:
        state = project.inspect(service)
        if state["RestartCount"] or not state["State"]["Running"]:
            out[service] = state["RestartCount"]
    return out


# -- the fleet at rest -------------------------------------------------------------------------------

REST_COMMANDS_PER_REPLICA = 20  # Redis's answers a second, per replica, with no request
REST_CPU_PERCENT = 2.0  # of one core: redis-server and each replica's server, with no request
OWN_COMMANDS = ("config|resetstat", "info")  # the measurement's own, not counted
# A container's CPU counter read from inside it: cgroup v2's cpu.stat, else v1's cpuacct (ns).
CPU_IN_CONTAINER = "cat /sys/fs/cgroup/cpu.stat 2>/dev/null || cat /sys/fs/cgroup/cpuacct/cpuacct.usage"


def cpu_usec(text):
    """µs of CPU in a cpu.stat (cgroup v2: usage_usec) or a cpuacct.usage (v1: ns)."""
    for line in text.splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1])
    return int(text.strip()) // 1000


def host_cpu_file(state):
    """The file on this host counting the CPU of the container `state` (`docker inspect`)
    describes: its cgroup's, as its first process's /proc/<pid>/cgroup names it; or None when
    this host does not see it."""
    cid, pid = state["Id"], state["State"]["Pid"]
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if cid not in path:  # another PID namespace's process, or not the container's group
            continue
        if controllers == "":
            candidates = [f"/sys/fs/cgroup{path}/cpu.stat"]
        elif "cpuacct" in controllers.split(","):
            candidates = [f"/sys/fs/cgroup/{d}{path}/cpuacct.usage" for d in ("cpuacct", "cpu,cpuacct")]
        else:
            continue
        for candidate in candidates:
            if os.path.isfile(candidate):
                return candidate
    return None


class CpuClock:
    """A container's CPU time in µs, from its cgroup's counter: the host's file when this host
    runs Redis (exact), else the container's own through `docker exec` (whose own few ms
    then count). On the host, also its main process's (the server's, all its threads; in
    clock ticks): the rest of the group's is what runs beside it (health checks' execs)."""

    def __init__(self, project, service):
        self.project, self.service = project, service
        state = project.inspect(service)
        self.file = host_cpu_file(state)
        self.main = f"/proc/{state['State']['Pid']}/stat" if self.file else None

    def read(self):
        """(time.monotonic(), µs of the group's CPU, µs of the main process's or None)."""
        main = None
        if self.main:
            with open(self.main) as f:
                utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
            main = (int(utime) + int(stime)) * 1_000_000 // os.sysconf("SC_CLK_TCK")
        if self.file:
            with open(self.file) as f:
                return time.monotonic(), cpu_usec(f.read()), main
        text = self.project.exec(self.service, "sh", "-c", CPU_IN_CONTAINER).stdout
        return time.monotonic(), cpu_usec(text), main


def cpu_percent(before, after):
    """% of one core between two CpuClock.read()s: the group's, its main process's (None when
    unseen), and the one the bound holds (the main process's when seen, else the group's)."""
    wall = (after[0] - before[0]) * 1e4  # µs per % of a core
    group = (after[1] - before[1]) / wall
    main = None if after[2] is None else (after[2] - before[2]) / wall
    return group, main, group if main is None else main


def command_calls(info):
    """{command: calls} of INFO commandstats."""
    calls = {}
    for line in info.splitlines():
        if line.startswith("cmdstat_"):
            name, _, fields = line[len("cmdstat_"):].partition(":")
            calls[name] = int(dict(f.split("=", 1) for f in fields.strip().split(","))["calls"])
    return calls


def print_rest(seconds, cpu, per_replica, rates, args):
    """The table of case_rest: each container's CPU (its server process's apart), and Redis's
    commands."""
    print(f"\nthe fleet at rest ({seconds:.1f} s measured after {args.rest_settle_s:.1f} s without requests):")
    print(f"{'container':<10} {'group_%':>7} {'server_%':>8}  notes")
    for service, (group, main, _) in cpu.items():
        notes = ""
        if service == "redis":
            top = ", ".join(f"{name} {rate:.2f}/s" for name, rate in rates[:8])
            notes = f"{per_replica:.2f} commands/s per replica ({len(REPLICAS)} replicas): {top or 'none'}"
        print(f"{service:<10} {group:>7.2f} {'-' if main is None else f'{main:.2f}':>8}  {notes}")
    print("(% of one core. group: the container's cgroup, health checks' execs included; server: its "
          "main process, to 0.1 %, what the bound holds when seen)", flush=True)


def case_rest(c):
    clocks = {s: CpuClock(c.project, s) for s in ["redis", *REPLICAS, *WORKERS, *BRIDGES, "router"]}
    time.sleep(c.args.rest_settle_s)
    c.project.exec("redis", "redis-cli", "CONFIG", "RESETSTAT")
    reset = time.monotonic()
    before = {s: clock.read() for s, clock in clocks.items()}
    time.sleep(c.args.rest_s)
    cpu = {s: cpu_percent(before[s], clock.read()) for s, clock in clocks.items()}
    info = c.project.exec("redis", "redis-cli", "INFO", "commandstats").stdout
    seconds = time.monotonic() - reset
    calls = {name: n for name, n in command_calls(info).items() if name not in OWN_COMMANDS}
    rates = sorted(((name, n / seconds) for name, n in calls.items()), key=lambda r: -r[1])
    per_replica = sum(calls.values()) / seconds / len(REPLICAS)
    print_rest(seconds, cpu, per_replica, rates, c.args)
    bounded = ["redis", *REPLICAS]
    notes = (f"Redis {per_replica:.2f} commands/s per replica ("
             + ", ".join(f"{name} {rate:.2f}/s" for name, rate in rates[:4]) + "); CPU % of a core: "
             + ", ".join(f"{s} {cpu[s][2]:.2f} (group {cpu[s][0]:.2f})" for s in bounded)
             + f" (bounds {REST_COMMANDS_PER_REPLICA}/s, {REST_CPU_PERCENT:g} %)")
    over = []
    if per_replica > REST_COMMANDS_PER_REPLICA:
        over.append(f"Redis answered {per_replica:.2f} commands/s per replica (bound {REST_COMMANDS_PER_REPLICA})")
    over += [f"{s} used {cpu[s][2]:.2f} % of a core (bound {REST_CPU_PERCENT:g} %)"
             for s in bounded if cpu[s][2] > REST_CPU_PERCENT]
    if over:
        raise RuntimeError(f"{'; '.join(over)}: {notes}")
    return notes


# -- traffic through the router ------------------------------------------------------------------

def routing_summary(decisions):
    """Routed, the hit ratio, and the blind decisions (the Indexer gave no signal) by reason."""
    routed = sum(decisions.values())
    hits = h.hit_decisions(decisions)
    blind = h.blind_decisions(decisions)
    return f"routed {routed}, hit {hits / max(routed, 1):.2f}, blind {sum(blind.values())} {blind or ''}".rstrip()


def routed_reason(fleet, traffic):
    """One request through the router: its x-routing-reason header."""
    tokens = traffic.prompt()
    body = json.dumps({"input_ids": tokens, "sampling_params": {"max_new_tokens": 1}}).encode()
    req = urllib.request.Request(f"{fleet.router_url}/generate", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()
        traffic.universe.update(h.block_hashes(tokens))
        return resp.headers.get("x-routing-reason")


def check_index(fleet, traffic, args):
    """Quiet: the index (every replica) against the workers' caches, and digests equal.
    Returns notes; raises when a replica over-claims, under-claims or differs."""
    settled = h.settle(fleet, traffic, time.time(), args)
    if settled["over"] or settled["under"]:
        raise RuntimeError(f"{REPLICAS[0]} against the workers: over {settled['over']}, under "
                           f"{settled['under']} (examples {settled['examples']})")
    for replica in REPLICAS[1:]:
        over = fleet.over_claimed(traffic, replica)
        if over:
            raise RuntimeError(f"{replica} over-claims {over} placements")
    fleet.wait_converged()
    return f"placements {settled['expected']}, over 0, under 0, digests equal"


# -- the cases -------------------------------------------------------------------------------------

class Ctx:
    """What every case uses: the project, the fleet's views, the traffic."""

    def __init__(self, project, fleet, traffic, args):
        self.project, self.fleet, self.traffic, self.args = project, fleet, traffic, args


def case_route(c):
    before = h.router_decisions(c.fleet.router_url)
    for _ in range(c.args.requests):
        c.traffic.one(c.fleet.router_url)
    reasons = [routed_reason(c.fleet, c.traffic) for _ in range(c.args.docs)]
    decisions = h.diff(h.router_decisions(c.fleet.router_url), before)
    if c.traffic.errors:
        raise RuntimeError(f"{c.traffic.errors} requests failed")
    if h.hit_decisions(decisions) < c.args.requests // 2 or "cache_hit" not in reasons:
        raise RuntimeError(f"too few cache hits: {decisions}, x-routing-reason {reasons}")
    return f"{routing_summary(decisions)}; {check_index(c.fleet, c.traffic, c.args)}"


SCRAPE_TARGETS = {"kv-indexer-server": 2, "kv-indexer-bridge": 3, "kv-indexer-router": 1}
# The metric names alert expressions use (kv_*, process_*, up; a histogram's _bucket/_count).
METRIC_NAME = re.compile(r"\b(kv_[a-z0-9_]+|process_[a-z0-9_]+|up)\b(?![-\"])")


def prometheus_api(c, path):
    answer = h.http_json(f"{c.project.url('prometheus', 9090)}/api/v1/{path}")
    if answer.get("status") != "success":
        raise RuntimeError(f"Prometheus /api/v1/{path}: {answer}")
    return answer["data"]


def targets_up(c):
    """(up, the targets not up) by job, from /api/v1/targets."""
    up, down = {}, []
    for target in prometheus_api(c, "targets?state=active")["activeTargets"]:
        job = target["labels"]["job"]
        if target["health"] == "up":
            up[job] = up.get(job, 0) + 1
        else:
            down.append(f"{target['scrapeUrl']} {target['health']} {target.get('lastError', '')}".strip())
    return up, down


def rules_evaluated(c):
    """Every alert rule: (name, health, last error, evaluated yet, its expression)."""
    return [(rule["name"], rule["health"], rule.get("lastError", ""),
             not rule.get("lastEvaluation", "").startswith("0001-"), rule["query"])
            for group in prometheus_api(c, "rules?type=alert")["groups"] for rule in group["rules"]]


def prometheus_status(c):
    """(targets up by job, targets not up, alert rules, metrics the rules name with no live series)."""
    up, down = targets_up(c)
    rules = rules_evaluated(c)
    names = sorted({name for *_, query in rules for name in METRIC_NAME.findall(query)})
    absent = [name for name in names
              if not prometheus_api(c, "query?query=" + urllib.parse.quote(f'count({{__name__="{name}"}})'))["result"]]
    return up, down, rules, names, absent


def case_prometheus(c):
    # Some traffic of its own, so that it stands alone (--only prometheus): the latency
    # histograms and the router's request counter have series only once something was
    # answered, and Prometheus sees them at its next scrape (every 15 s): waited for.
    for _ in range(c.args.docs):
        c.traffic.one(c.fleet.router_url)
    deadline = time.monotonic() + c.args.deadline_s
    while True:
        up, down, rules, names, absent = prometheus_status(c)
        evaluated = rules and all(evaluated for *_, evaluated, _ in rules)
        if up == SCRAPE_TARGETS and evaluated and not absent:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"targets up {up} (want {SCRAPE_TARGETS}), not up: {down}; rules evaluated "
                               f"{sum(r[3] for r in rules)} of {len(rules)}; metrics named by alerts with no "
                               f"live series: {absent}")
        time.sleep(1)
    failing = [f"{name}: {health} {error}" for name, health, error, _, _ in rules if health != "ok"]
    if failing:
        raise RuntimeError(f"rules failing: {failing}")
    return (f"{sum(up.values())} targets up {up}; {len(rules)} alert rules evaluated, health ok; "
            f"the {len(names)} metrics they name all have live series")


def case_kill(c):
    k = 0

    def kill(_load):
        c.project.docker("kill", REPLICAS[k])
        time.sleep(c.args.down_s)
        c.project.docker("start", REPLICAS[k])
        return c.fleet.wait_fresh(k)

    back, _, decisions, failed = h.routing_window(c.fleet.router_url, c.traffic, kill)
    gone = restarts(c.project, [*BRIDGES, *WORKERS, "router", REPLICAS[1]])
    if failed or gone or not h.hit_decisions(decisions):
        raise RuntimeError(f"{failed} requests failed; restarted or stopped: {gone}; decisions {decisions}")
    # The routers try the killed replica last once it has failed them: a few decisions may go
    # blind (it spent their budget), not a tenth of them (116-162 of 280 before, every one).
    if sum(h.blind_decisions(decisions).values()) > sum(decisions.values()) / 10:
        raise RuntimeError(f"blind routing while a replica was down: {routing_summary(decisions)}")
    return (f"serving {back:.2f} s after its start; 0 failed, {routing_summary(decisions)}; "
            f"{check_index(c.fleet, c.traffic, c.args)}")


def cut_off(c, k, network, seconds):
    """Disconnects replica k from `network` for `seconds`; returns seconds from the cut (its
    leg gone, as the container saw it) to NOT_SERVING by gRPC health (the answer, and when
    that check began) and by /state, the disconnect's own time, whether it answered SERVING
    during the cut, and its lag then by /state and by LAG_METRIC."""
    replica = REPLICAS[k]
    container = c.project.container(replica)
    watch = CutWatch(c.project, replica, network)
    began = time.time()
    run(["docker", "network", "disconnect", network, container])
    took = time.time() - began
    try:
        h.wait_until(lambda: not c.fleet.fresh(k), f"{replica} to stop serving", timeout=10, interval=0.01)
        stale_at = time.time()
        cut, (check_began, not_serving) = watch.times()
        during = serving(c.project, replica)
        lags = (c.fleet.state(k).get("lag_ms"), lag_metric(c.fleet, k))
        time.sleep(max(0.0, seconds - (time.time() - cut)))
    finally:
        run(["docker", "network", "connect", "--alias", replica, network, container])
    return not_serving - cut, check_began - cut, stale_at - cut, took, during, lags


def case_partition(c):
    k, bound = 0, c.args.max_lag_ms / 1000 + 0.5
    if not serving(c.project, REPLICAS[k]):
        raise RuntimeError(f"{REPLICAS[k]} is not SERVING before the cut")
    # One sender: the log moves and the router is tested, and the CPU is left to the health
    # checks, whose own latency counts against the bound.
    load = h.RouterLoad(c.fleet.router_url, c.traffic, threads=1)
    try:
        time.sleep(1.0)
        health, began, stale, took, during, lags = cut_off(c, k, c.project.network_name("log"), 3.0)
        back = c.fleet.wait_fresh(k)
        after = serving(c.project, REPLICAS[k])
    finally:
        decisions, failed = load.stop()
    notes = (f"NOT_SERVING {health:.2f} s after the cut (that check began at {began:.2f} s; /state "
             f"{stale:.2f} s; bound {bound:.2f} s; "
             f"`docker network disconnect` took {took:.2f} s; lag then: /state {lags[0]} ms, "
             f"{LAG_METRIC} {lags[1]} ms), serving {back:.2f} s after reconnecting; "
             f"{failed} failed, {routing_summary(decisions)}")
    # The lag must show where alerts read it, not only in /state.
    if health > bound or stale > bound or during or not after or failed or not (lags[1] or 0) > c.args.max_lag_ms:
        raise RuntimeError(f"{notes}; SERVING during the cut: {during}, after: {after}")
    return f"{notes}; {check_index(c.fleet, c.traffic, c.args)}"


LAG_METRIC = "kv_indexer_fleet_lag_seconds"


def lag_metric(fleet, k):
    """LAG_METRIC on replica k's /metrics, in ms (None when it exports none)."""
    fleet.state(k)  # the admin address, looked up
    with urllib.request.urlopen(f"{fleet.admin[k]}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(LAG_METRIC):
                return round(float(line.rsplit(" ", 1)[1]) * 1000)
    return None


def index_sizes(fleet):
    """Every replica's (digest, placements)."""
    return [(s["digest"], s["placements"]) for s in map(fleet.state, range(fleet.replicas))]


def case_redis(c):
    c.fleet.wait_converged()
    before = index_sizes(c.fleet)
    start = time.time()
    c.project.docker("restart", "redis", "-t", "10")
    h.wait_until(lambda: c.project.inspect("redis")["State"].get("Health", {}).get("Status") == "healthy",
                  "redis to be healthy", timeout=60, interval=0.1)
    c.fleet.wait_all_fresh()
    back = time.time() - start
    c.fleet.wait_converged()
    after = index_sizes(c.fleet)
    if after != before:
        raise RuntimeError(f"the index changed across the restart: {before} -> {after}")
    notes = check_index(c.fleet, c.traffic, c.args)
    reasons = [routed_reason(c.fleet, c.traffic) for _ in range(c.args.docs)]
    if "cache_hit" not in reasons:
        raise RuntimeError(f"no cache hit after the restart: {reasons}")
    return (f"every replica serving {back:.2f} s after the restart began; {before[0][1]} placements "
            f"and the digests unchanged; {notes}")


RUNNERS = {"rest": case_rest, "route": case_route, "prometheus": case_prometheus, "kill": case_kill, "partition": case_partition,
           "redis": case_redis}


# -- main ------------------------------------------------------------------------------------------

def ensure_images(args):
    if args.build:
        subprocess.run([os.path.join(ROOT, "scripts", "build_image.sh"), "--profile", args.profile,
                        "--tag", args.image], check=True)
    for image in (args.image, args.redis_image, args.prometheus_image):
        if run(["docker", "image", "inspect", image], check=False).returncode != 0:
            raise SystemExit(f"image {image} is missing: run scripts/build_image.sh (or pass --build)")


def run_case(name, ctx):
    """(ok, seconds, notes) of one case."""
    print(f"running {name}: {CASES[name]} …", file=sys.stderr, flush=True)
    start = time.time()
    try:
        notes, ok = RUNNERS[name](ctx), True
    except Exception as error:
        notes, ok = f"FAILED: {error}", False
        print(f"  {name} failed: {error}", file=sys.stderr, flush=True)
    return ok, time.time() - start, notes


def print_table(rows):
    print(f"\n{'case':<10} {'description':<46} {'result':<6} {'time_s':>7}  notes")
    for name, ok, seconds, notes in rows:
        print(f"{name:<10} {CASES[name]:<46} {'ok' if ok else 'FAIL':<6} {seconds:>7.1f}  {notes}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(CASES), help="comma-separated cases: " + ", ".join(CASES))
    ap.add_argument("--build", action="store_true", help="run scripts/build_image.sh first")
    ap.add_argument("--profile", default="release", help="the cargo profile --build uses")
    ap.add_argument("--image", default="kv-indexer:latest", help="the Indexer's image")
    ap.add_argument("--redis-image", default="redis:7.0-bookworm")
    ap.add_argument("--prometheus-image", default="prom/prometheus:v2.42.0")
    ap.add_argument("--keep", action="store_true", help="leave the project up (to look around)")
    ap.add_argument("--max-lag-ms", type=int, default=1000, help="KV_INDEXER_MAX_LAG_MS of the replicas")
    ap.add_argument("--requests", type=int, default=60, help="requests through the router in `route`")
    ap.add_argument("--down-s", type=float, default=2.0, help="how long the killed replica stays down")
    ap.add_argument("--rest-settle-s", type=float, default=3.0, help="`rest`: seconds without requests first")
    ap.add_argument("--rest-s", type=float, default=10.0, help="`rest`: the seconds measured")
    for flag, kind, default in [("--docs", int, 8), ("--doc-tokens", int, 512), ("--suffix-tokens", int, 64),
                                ("--stable-s", float, 4.0), ("--deadline-s", float, 60.0),
                                ("--poll-s", float, 0.3), ("--seed", int, 23)]:
        ap.add_argument(flag, type=kind, default=default)
    args = ap.parse_args()
    cases = h.selected(ap, args.only, CASES)
    ensure_images(args)

    project = Project(f"kvtest{os.getpid()}{int(time.time()) % 100000}", args)
    logs = tempfile.mkdtemp(prefix="kv-compose-tests-")
    signal.signal(signal.SIGTERM, lambda s, _f: sys.exit(128 + s))
    rows = []
    try:
        started = time.time()
        project.up()
        fleet = ComposeFleet(project)
        wait_started(project, fleet)
        print(f"project {project.name} up and serving in {time.time() - started:.1f} s", file=sys.stderr)
        ctx = Ctx(project, fleet, h.Traffic(args, args.seed), args)
        for name in cases:
            rows.append((name, *run_case(name, ctx)))
    finally:
        project.save_logs(os.path.join(logs, "compose.log"))
        if args.keep:
            print(f"left up: {' '.join(project.base)} down -v", file=sys.stderr)
        else:
            project.down()
    print_table(rows)
    print(f"\ncontainer logs: {logs}/compose.log")
    return 0 if rows and all(ok for _, ok, _, _ in rows) and len(rows) == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
