#!/usr/bin/env python3
"""Live end-to-end check: vLLM 0.33.0's real ZmqEventPublisher -> kv-indexer-bridge
(--engine vllm) -> kv-indexer-server, compared placement by placement with a model.

Usage (see scripts/vllm/README.md for the wheel and the venv; build the binaries first):

    cargo build --bin kv-indexer-server --bin kv-indexer-bridge --bin kv-indexer-ctl
    VLLM_WHEEL=/tmp/vllm/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl \\
        /tmp/vllm/venv/bin/python scripts/vllm/live_e2e.py [--seed 1] [--batches 300]

The python must have msgspec, pyzmq and cbor2 (the venv of scripts/vllm/README.md).
Exit status: 0 when the index holds exactly the model's placements (0 missing, 0 extra),
1 when it does not, 2 when the run could not be made (a process failed to start, ...).

What it does:
1. Starts kv-indexer-server on a free loopback port (in memory) and waits for
   `kv-indexer-ctl health`; starts the wheel's real ZmqEventPublisher (PUB bound on
   tcp://*:PORT, replay ROUTER on 127.0.0.1, topic "kv-events", data_parallel_rank 0) and
   the bridge with the replay endpoint and a metrics address; publishes empty batches until
   the bridge's kv_bridge_batches_received_total shows two of them arrived live.
2. Publishes a seeded stream of KVEventBatch built from real vLLM block hashes (sha256,
   get_request_block_hasher, block size 16, prompts of 1-8 full blocks sharing prefixes):
   BlockStored of what the GPU pool did not hold yet (parent_block_hash per vLLM: the block
   before the run, None from block 0), GPU evictions as one BlockRemoved per hash (some with
   medium None), CPU / STORAGE offloads and their removals shaped as vLLM's offloading
   managers write them, and three AllBlocksCleared. Each batch picks the int or the raw-digest hash form
   (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES through the real maybe_convert_block_hash).
3. Before --kill-at, waits for the index to equal the model (the live path alone), then kills
   the bridge (SIGKILL), publishes on while it is down and starts it again before
   --restart-at: at start it clears the worker and replays the publisher's buffer from seq 0
   while the publisher goes on publishing.
4. At the end polls `kv-indexer-ctl --json match` over every hash ever published until the
   worker's placements equal the model (or --timeout), prints a summary and, on a mismatch,
   the diff and the bridge's log.

The model follows the bridge contract: medium GPU or nil -> HBM, CPU -> DRAM, STORAGE -> SSD;
an int hash is read as a signed i64, a digest by its last 8 bytes big-endian; AllBlocksCleared
clears every tier; an event of another group than 0 is refused and the worker cleared after
its batch. Every process started here is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ beside the scripts
os.environ.pop("PYTHONHASHSEED", None)  # NONE_HASH from vLLM's default seed

import vllm_wheel_loader  # noqa: E402

V = vllm_wheel_loader.load()
KE, KCU, HASHING = V.kv_events, V.kcu, V.hashing

BLOCK_SIZE = 16
VOCAB = 152064
TOPIC = "kv-events"
WORKER_ID = "vllm-e2e-0"
WORKER_ADDRESS = "http://127.0.0.1:8000"
TIERS = ("HBM", "DRAM", "SSD")
MEDIUM_TIER = {KE.MEDIUM_GPU: "HBM", None: "HBM", KE.MEDIUM_CPU: "DRAM", KE.MEDIUM_STORAGE: "SSD"}
# Blocks each medium holds before it evicts (small, so evictions are frequent).
CAPACITY = {KE.MEDIUM_GPU: 128, KE.MEDIUM_CPU: 64, KE.MEDIUM_STORAGE: 96}
MATCH_CHUNK = 2000


# ---------------------------------------------------------------------------------------------
# The model: what the index must hold for the worker, from the events as published.


def signed_hash(value) -> int:
    """The bridge's i64 for a vLLM hash: an int's u64 bits, or a digest's last 8 bytes (BE)."""
    if isinstance(value, int):
        return value - (1 << 64) if value >= (1 << 63) else value
    return int.from_bytes(bytes(value)[-8:], "big", signed=True)


class Model:
    def __init__(self):
        self.tiers = {tier: set() for tier in TIERS}
        self.universe = set()  # every hash ever published in block_hashes

    def clear(self):
        for held in self.tiers.values():
            held.clear()

    def apply(self, batch):
        for event in batch.events:
            if isinstance(event, KE.AllBlocksCleared):
                self.clear()
                continue
            assert event.group_idx in (None, 0), "the stream has one KV-cache group"
            hashes = [signed_hash(h) for h in event.block_hashes]
            self.universe.update(hashes)
            held = self.tiers[MEDIUM_TIER[event.medium]]
            if isinstance(event, KE.BlockStored):
                held.update(hashes)
            else:
                held.difference_update(hashes)

    def placements(self) -> int:
        return sum(len(held) for held in self.tiers.values())


# ---------------------------------------------------------------------------------------------
# The workload: a seeded stream of batches as a vLLM worker with offloading would publish.


def block_hasher():
    fn = HASHING.get_hash_fn_by_name("sha256")
    KCU.init_none_hash(fn)
    hasher = KCU.get_request_block_hasher(BLOCK_SIZE, fn)

    def hashes(tokens):
        request = types.SimpleNamespace(
            block_hashes=[], num_tokens=len(tokens), all_token_ids=tokens, mm_features=[],
            lora_request=None, cache_salt=None, prompt_embeds=None)
        return hasher(request)

    return hashes


def external(digest):
    """vLLM's published form of a hash, per VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""
    return KCU.maybe_convert_block_hash(digest)


class Workload:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.hashes = block_hasher()
        self.families = [self.tokens(self.rng.randint(0, 4) * BLOCK_SIZE) for _ in range(10)]
        self.history: list[list[int]] = []
        # medium -> {digest: None}, oldest first (LRU order)
        self.held = {medium: {} for medium in CAPACITY}
        self.blocks = {}  # digest -> (parent digest or None, token ids)
        self.counts = collections.Counter()

    def tokens(self, n):
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def forget_all(self):
        for held in self.held.values():
            held.clear()

    # -- events ------------------------------------------------------------------------------

    def stored(self, digests, parent, tokens, medium, **extra):
        self.counts["BlockStored"] += 1
        return KE.BlockStored(
            block_hashes=[external(d) for d in digests],
            parent_block_hash=None if parent is None else external(parent),
            token_ids=list(tokens), block_size=BLOCK_SIZE, lora_id=None, medium=medium,
            lora_name=None, group_idx=extra.pop("group_idx", 0), **extra)

    def removed(self, digests, medium, **extra):
        self.counts["BlockRemoved"] += 1
        return KE.BlockRemoved(block_hashes=[external(d) for d in digests], medium=medium,
                               group_idx=0, **extra)

    # -- steps -------------------------------------------------------------------------------

    def prompt(self):
        """A prompt of 1-8 full blocks plus a partial tail: a follow-up turn, a repeat, or a
        shared family prefix with a fresh continuation."""
        roll = self.rng.random()
        if self.history and roll < 0.25:
            base = self.rng.choice(self.history)
            room = 8 - len(base) // BLOCK_SIZE
            tokens = base[: len(base) // BLOCK_SIZE * BLOCK_SIZE]
            tokens = tokens + self.tokens(self.rng.randint(1, max(1, room)) * BLOCK_SIZE)
            tokens = tokens[: 8 * BLOCK_SIZE]
        elif self.history and roll < 0.40:
            tokens = list(self.rng.choice(self.history))
        else:
            family = self.rng.choice(self.families)
            total = self.rng.randint(max(1, len(family) // BLOCK_SIZE), 8)
            tokens = family + self.tokens(total * BLOCK_SIZE - len(family))
        tokens = tokens + self.tokens(self.rng.randrange(BLOCK_SIZE))  # never hashed
        self.history.append(tokens)
        return tokens

    def evict(self, medium, room, in_use=()):
        """Evicts the oldest blocks not `in_use` until `room` more fit: GPU as one BlockRemoved
        per hash (BlockPool), CPU/STORAGE as one multi-hash BlockRemoved (offloading)."""
        held = self.held[medium]
        excess = len(held) + room - CAPACITY[medium]
        if excess <= 0:
            return []
        victims = [d for d in held if d not in in_use][:excess]
        for digest in victims:
            del held[digest]
        if medium == KE.MEDIUM_GPU:
            # A few without a medium: the bridge reads nil as the GPU pool's.
            return [self.removed([d], self.rng.choice([medium] * 4 + [None])) for d in victims]
        return [self.removed(victims, medium, locality="LOCAL")]

    def request(self):
        """A request's prefill: the blocks past the GPU prefix hit are stored, as one event or
        one per block (each chained to the block before)."""
        tokens = self.prompt()
        digests = self.hashes(tokens)
        gpu = self.held[KE.MEDIUM_GPU]
        hit = 0
        while hit < len(digests) and digests[hit] in gpu:
            gpu[digests[hit]] = gpu.pop(digests[hit])  # touch: most recently used
            hit += 1
        new = digests[hit:]
        if not new:
            return []
        events = self.evict(KE.MEDIUM_GPU, len(new), set(digests))
        for i, digest in enumerate(new, start=hit):
            self.blocks[digest] = (digests[i - 1] if i else None,
                                   tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            gpu[digest] = None
        if self.rng.random() < 0.5:
            parent = digests[hit - 1] if hit else None
            span = tokens[hit * BLOCK_SIZE:len(digests) * BLOCK_SIZE]
            events.append(self.stored(new, parent, span, KE.MEDIUM_GPU))
        else:
            events += [self.stored([d], *self.blocks[d], KE.MEDIUM_GPU) for d in new]
        return events

    def offload(self):
        """1-4 GPU blocks copied to CPU or STORAGE, one BlockStored per block as
        simple_kv_offload writes them (spec kind, locality LOCAL)."""
        medium = self.rng.choice([KE.MEDIUM_CPU, KE.MEDIUM_CPU, KE.MEDIUM_STORAGE])
        candidates = [d for d in self.held[KE.MEDIUM_GPU] if d not in self.held[medium]]
        if not candidates:
            return []
        chosen = self.rng.sample(candidates, min(len(candidates), self.rng.randint(1, 4)))
        events = self.evict(medium, len(chosen))
        for digest in chosen:
            self.held[medium][digest] = None
            parent, tokens = self.blocks[digest]
            events.append(self.stored([digest], parent, tokens, medium,
                                      kv_cache_spec_kind="full_attention", locality="LOCAL"))
        return events

    def cleared(self):
        self.counts["AllBlocksCleared"] += 1
        self.forget_all()
        return [KE.AllBlocksCleared()]

    def batch(self, index, specials):
        """Batch `index` (never empty, as the scheduler publishes only non-empty ones)."""
        use_int = self.rng.random() < 0.5
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if use_int else "0"
        self.counts["int_batches" if use_int else "digest_batches"] += 1
        events = []
        while not events:
            for _ in range(self.rng.choice([1, 1, 2, 3])):
                events += self.request()
            if self.rng.random() < 0.3:
                events += self.offload()
        special = specials.get(index)
        if special == "clear":
            events += self.cleared()
        return KE.KVEventBatch(ts=1767225600.0 + index * 0.05, events=events)


# ---------------------------------------------------------------------------------------------
# Processes.


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Proc:
    """A child process in its own session (Ctrl-C reaches only us), logging to a file."""

    def __init__(self, name, argv, env, log_dir):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(argv, env={**os.environ, **env}, stdout=self.log,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self):
        if self.alive():
            self.popen.kill()
        self.popen.wait()
        self.log.close()

    def stop(self, timeout=5.0):
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def tail(self, lines=25) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, "rb") as f:
            return "".join(f.read().decode(errors="replace").splitlines(True)[-lines:])


class Failure(Exception):
    """The run could not be made (exit 2)."""


def wait_for(what, check, timeout, procs=(), interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if not proc.alive():
                raise Failure(f"{proc.name} exited while waiting for {what}:\n{proc.tail()}")
        if check():
            return
        time.sleep(interval)
    raise Failure(f"timed out after {timeout}s waiting for {what}")


class Ctl:
    def __init__(self, bin_dir, endpoint):
        self.argv = [os.path.join(bin_dir, "kv-indexer-ctl"), "--endpoint", endpoint]

    def run(self, *args):
        return subprocess.run(self.argv + list(args), capture_output=True, text=True, timeout=30)

    def healthy(self) -> bool:
        return self.run("health").returncode == 0

    def placements(self, universe):
        """{worker_id: {tier: set(hash)}} over `universe`, asked in chunks."""
        found = collections.defaultdict(lambda: {tier: set() for tier in TIERS})
        hashes = sorted(universe)
        for start in range(0, len(hashes), MATCH_CHUNK):
            chunk = [str(h) for h in hashes[start:start + MATCH_CHUNK]]
            out = self.run("--json", "match", "--", *chunk)
            if out.returncode != 0:
                raise Failure(f"kv-indexer-ctl match failed: {out.stderr or out.stdout}")
            for node in json.loads(out.stdout)["matches"]:
                for tier in node["tiers"]:
                    found[node["worker_id"]][tier["tier"].upper()].update(tier["hashes"])
        return found


def start_server(bin_dir, log_dir, port):
    return Proc("server", [os.path.join(bin_dir, "kv-indexer-server")],
                {"KV_INDEXER_LISTEN_ADDR": f"127.0.0.1:{port}", "RUST_LOG": "info"}, log_dir)


def start_bridge(bin_dir, log_dir, name, server_port, pub_port, replay_port, metrics_port):
    return Proc(name, [os.path.join(bin_dir, "kv-indexer-bridge")], {
        "KV_INDEXER_WORKER_ID": WORKER_ID,
        "KV_INDEXER_WORKER_ADDRESS": WORKER_ADDRESS,
        "KV_INDEXER_ENDPOINT": f"http://127.0.0.1:{server_port}",
        "KV_INDEXER_ENGINE": "vllm",
        "SGLANG_KV_EVENT_ENDPOINT": f"tcp://127.0.0.1:{pub_port}",
        "SGLANG_KV_EVENT_TOPIC": TOPIC,
        "SGLANG_KV_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay_port}",
        "KV_INDEXER_BRIDGE_METRICS_ADDR": f"127.0.0.1:{metrics_port}",
        "RUST_LOG": "info",
    }, log_dir)


def bridge_metrics(port) -> dict[str, float]:
    """The bridge's kv_bridge_* series, `name{labels}` -> value; {} while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    series = {}
    for line in text.splitlines():
        match = re.match(r"(kv_bridge_\w+)(\{[^}]*\})?\s+(\S+)$", line)
        if match:
            labels = re.sub(r'worker="[^"]*",?', "", match.group(2) or "").replace("{}", "")
            series[match.group(1) + labels] = float(match.group(3))
    return series


def batches_received(port) -> int:
    return int(bridge_metrics(port).get("kv_bridge_batches_received_total", 0))


# ---------------------------------------------------------------------------------------------
# The run.


class Publisher:
    """The wheel's ZmqEventPublisher, counting what it was given."""

    def __init__(self, pub_port, replay_port):
        self.pub = KE.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=f"tcp://*:{pub_port}",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic=TOPIC)
        self.published = 0

    def publish(self, batch):
        self.pub.publish(batch)
        self.published += 1

    def drain(self, timeout=10.0):
        """Waits until the publisher thread has sent everything queued."""
        deadline = time.monotonic() + timeout
        while self.pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)

    def shutdown(self):
        self.pub.shutdown()


def warm_up(publisher, metrics_port, bridge, timeout=30.0):
    """Publishes empty batches until two in a row reach the bridge: the first may come by its
    start-up replay, the second only through a live subscription (PUB/SUB slow joiner)."""
    in_a_row = 0
    deadline = time.monotonic() + timeout
    while in_a_row < 2:
        if time.monotonic() > deadline:
            raise Failure("the bridge never received the warm-up batches live")
        if not bridge.alive():
            raise Failure(f"the bridge exited during the warm-up:\n{bridge.tail()}")
        publisher.publish(KE.KVEventBatch(ts=time.time(), events=[]))
        publisher.drain()
        in_a_row = in_a_row + 1 if caught_up(publisher, metrics_port, 0.5) else 0


def caught_up(publisher, metrics_port, timeout) -> bool:
    """Whether the bridge has received every batch published, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while batches_received(metrics_port) < publisher.published:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def placement_diff(model, found):
    """(missing, extra): {tier: sorted hashes}, `extra` also holding other workers' hashes."""
    mine = found.get(WORKER_ID, {tier: set() for tier in TIERS})
    missing = {tier: sorted(model.tiers[tier] - mine[tier]) for tier in TIERS}
    extra = {tier: sorted(mine[tier] - model.tiers[tier]) for tier in TIERS}
    for worker, tiers in found.items():
        if worker != WORKER_ID:
            for tier, hashes in tiers.items():
                extra[tier] += sorted(hashes)
    return missing, extra


def converge(ctl, model, timeout):
    """Polls the index until it equals the model; the last (missing, extra)."""
    deadline = time.monotonic() + timeout
    while True:
        missing, extra = placement_diff(model, ctl.placements(model.universe))
        done = not any(missing.values()) and not any(extra.values())
        if done or time.monotonic() > deadline:
            return missing, extra
        time.sleep(0.5)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--interval-ms", type=float, default=10.0,
                        help="pause between two batches (default 10)")
    parser.add_argument("--kill-at", type=int, default=None,
                        help="kill the bridge before this batch (default 40%% of --batches)")
    parser.add_argument("--restart-at", type=int, default=None,
                        help="start it again before this batch (default 55%% of --batches)")
    parser.add_argument("--no-restart", action="store_true", help="never kill the bridge")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds the index may take to converge (default 30)")
    parser.add_argument("--bin-dir", default=os.path.join(REPO, "target", "debug"))
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    if args.kill_at is None:
        args.kill_at = args.batches * 2 // 5
    if args.restart_at is None:
        args.restart_at = args.batches * 11 // 20
    if args.no_restart:
        args.kill_at = args.restart_at = None
    elif not 0 < args.kill_at <= args.restart_at < args.batches:
        parser.error("need 0 < --kill-at <= --restart-at < --batches")
    return args


def specials(n):
    """Batch index -> special event. With the default kill/restart points: a clear seen live by
    the first bridge, a clear published while the bridge is down (seen by replay only), a clear
    seen live by the second bridge. (A hybrid model's second KV-cache group latches the worker
    as never matched; crates/kv-bridge/tests/bridge/vllm.rs tests that with this
    publisher's bytes.)"""
    return {n // 4: "clear", n // 2: "clear", n * 7 // 10: "clear"}


def by_tier(hashes) -> str:
    return ", ".join(f"{tier} {len(hashes[tier])}" for tier in TIERS)


def check(label, ctl, model, timeout) -> bool:
    """Waits for the index to equal the model; prints the outcome and any diff."""
    started = time.monotonic()
    missing, extra = converge(ctl, model, timeout)
    n_missing, n_extra = sum(map(len, missing.values())), sum(map(len, extra.values()))
    print(f"{label}: expected {model.placements()} placements ({by_tier(model.tiers)}) over "
          f"{len(model.universe)} hashes; missing {n_missing} ({by_tier(missing)}); "
          f"extra {n_extra} ({by_tier(extra)}); {time.monotonic() - started:.1f}s")
    for name, diff_ in (("missing", missing), ("extra", extra)):
        for tier in TIERS:
            if diff_[tier]:
                more = " ..." if len(diff_[tier]) > 50 else ""
                print(f"  {name} {tier}: {diff_[tier][:50]}{more}")
    return n_missing == 0 and n_extra == 0


def run(args, procs, log_dir) -> bool:
    started = time.monotonic()
    server_port, pub_port, replay_port = free_port(), free_port(), free_port()
    ctl = Ctl(args.bin_dir, f"http://127.0.0.1:{server_port}")
    procs.append(start_server(args.bin_dir, log_dir, server_port))
    wait_for("kv-indexer-ctl health", ctl.healthy, 30, procs)

    publisher = Publisher(pub_port, replay_port)
    procs.append(publisher)
    metrics_port = free_port()
    bridge = start_bridge(args.bin_dir, log_dir, "bridge-1", server_port, pub_port,
                          replay_port, metrics_port)
    procs.append(bridge)
    warm_up(publisher, metrics_port, bridge)
    warm = publisher.published
    print(f"ready in {time.monotonic() - started:.1f}s: server :{server_port}, publisher "
          f":{pub_port} (replay :{replay_port}), bridge received {warm} empty batches")

    workload, model = Workload(args.seed), Model()
    special = specials(args.batches)
    passed = True
    for index in range(args.batches):
        if index == args.kill_at:
            publisher.drain()
            caught_up(publisher, metrics_port, args.timeout)
            passed &= check(f"batch {index}, before the kill", ctl, model, args.timeout)
            bridge.kill()
            print(f"batch {index}: bridge killed (SIGKILL)")
        if index == args.restart_at:
            metrics_port = free_port()
            bridge = start_bridge(args.bin_dir, log_dir, "bridge-2", server_port, pub_port,
                                  replay_port, metrics_port)
            procs.append(bridge)
            print(f"batch {index}: bridge started again (clears, replays from seq 0)")
        batch = workload.batch(index, special)
        model.apply(batch)
        publisher.publish(batch)
        down = args.kill_at is not None and args.kill_at <= index < args.restart_at
        if not down and not bridge.alive():
            raise Failure(f"{bridge.name} exited:\n{bridge.tail()}")
        time.sleep(args.interval_ms / 1000)
    publisher.drain()
    streamed = time.monotonic()
    caught_up(publisher, metrics_port, args.timeout)  # then the applies may still be in flight
    passed &= check(f"batch {args.batches}, the end", ctl, model, args.timeout)

    counts = workload.counts
    events = counts["BlockStored"] + counts["BlockRemoved"] + counts["AllBlocksCleared"]
    print(f"\nseed {args.seed}: {args.batches} batches + {warm} warm-up empties published "
          f"(hash form: {counts['int_batches']} int, {counts['digest_batches']} digest)")
    print(f"events: {events} (BlockStored {counts['BlockStored']}, BlockRemoved "
          f"{counts['BlockRemoved']}, AllBlocksCleared {counts['AllBlocksCleared']}; "
          f"specials at {special})")
    metrics = bridge_metrics(metrics_port)
    shown = ["kv_bridge_batches_received_total", "kv_bridge_gaps_total"]
    shown += sorted(k for k in metrics if metrics[k] and k.startswith((
        "kv_bridge_replays_total", "kv_bridge_clears_total", "kv_bridge_events_skipped_total",
        "kv_bridge_batches_skipped_total")))
    print(f"{bridge.name} metrics: " + ", ".join(
        f"{k.replace('kv_bridge_', '')} {metrics.get(k, 0):g}" for k in shown))
    print(f"time: stream {streamed - started:.1f}s, total {time.monotonic() - started:.1f}s")
    print("PASS" if passed else "FAIL")
    if not passed:
        print(f"\n--- {bridge.name} log (tail) ---\n{bridge.tail(40)}")
    return passed


def interrupt(signum, frame):
    raise KeyboardInterrupt


def main():
    args = parse_args()
    # Ctrl-C and SIGTERM both end in the clean-up below (SIGINT even when started ignoring it).
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    for name in ("kv-indexer-server", "kv-indexer-bridge", "kv-indexer-ctl"):
        if not os.access(os.path.join(args.bin_dir, name), os.X_OK):
            sys.exit(f"{name} not found in {args.bin_dir}: cargo build --bin {name}")
    log_dir = tempfile.mkdtemp(prefix="live_e2e.")
    procs = []
    code = 2
    try:
        code = 0 if run(args, procs, log_dir) else 1
    except Failure as failure:
        print(f"error: {failure}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    finally:
        for proc in reversed(procs):
            if isinstance(proc, Publisher):
                proc.shutdown()
            else:
                proc.stop()
        if args.keep_logs or code != 0:
            print(f"logs: {log_dir}")
        else:
            for name in os.listdir(log_dir):
                os.remove(os.path.join(log_dir, name))
            os.rmdir(log_dir)
    sys.exit(code)


if __name__ == "__main__":
    main()
