#!/usr/bin/env python3
"""KV-event wire fixtures captured from vLLM 0.33.0's own ZmqEventPublisher.

Usage (see scripts/vllm/README.md):  VLLM_WHEEL=<vllm-0.33.0 wheel> <venv>/bin/python scripts/vllm/make_event_fixtures.py
Writes: event_fixtures.json beside this script

The real vllm/distributed/kv_events.py (structs + ZmqEventPublisher) and
vllm/v1/core/kv_cache_utils.py are executed from the wheel via
vllm_wheel_loader.py.  A plain pyzmq SUB socket binds tcp://127.0.0.1:<port>;
the publisher is given endpoint tcp://127.0.0.1:<port> (no '*' -> it connects).
Block hashes are real: sha256 (default algo), NONE_HASH from the default
seed (PYTHONHASHSEED unset), converted with the real maybe_convert_block_hash
under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 or =0.
Before the fixtures, warm_up() publishes empty batches until the SUB sees one
(slow-joiner), then resets the publisher's seq counter/buffer to 0.
Batch timestamps are fixed (vLLM uses time.time()) so payloads are stable.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.pop("PYTHONHASHSEED", None)  # NONE_HASH from the default seed

import msgspec  # noqa: E402
import zmq  # noqa: E402

import vllm_wheel_loader  # noqa: E402

V = vllm_wheel_loader.load()
KE, KCU, HASHING = V.kv_events, V.kcu, V.hashing
BS = 16


def jsonable(x):
    if isinstance(x, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(x).hex()}
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def real_hashes(token_ids, lora=None):
    fn = HASHING.get_hash_fn_by_name("sha256")
    KCU.init_none_hash(fn)
    req = types.SimpleNamespace(
        block_hashes=[], num_tokens=len(token_ids), all_token_ids=token_ids,
        mm_features=[], lora_request=lora, cache_salt=None, prompt_embeds=None)
    return KCU.get_request_block_hasher(BS, fn)(req)


def ext(h, use_int: bool):
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if use_int else "0"
    return KCU.maybe_convert_block_hash(h)


TOKENS = [(i * 7919 + 13) % 152064 for i in range(3 * BS + 5)]  # 3 full blocks + 5
H = real_hashes(TOKENS)
LORA = types.SimpleNamespace(lora_name="my-lora", lora_path="/adapters/my-lora",
                             name="my-lora", adapter_id=7)
TOKENS_L = TOKENS[: 2 * BS]
HL = real_hashes(TOKENS_L, LORA)

# A real block hash whose int form is >= 2**63 (msgpack uint64, 0xcf).
salt = 0
while True:
    toks_big = [(i * 31 + salt) % 152064 for i in range(BS)]
    h_big = real_hashes(toks_big)[0]
    if ext(h_big, True) >= 2**63:
        break
    salt += 1


def stored(hashes, parent, tokens, use_int=True, **kw):
    base = dict(
        block_hashes=[ext(h, use_int) for h in hashes],
        parent_block_hash=None if parent is None else ext(parent, use_int),
        token_ids=list(tokens), block_size=BS, lora_id=None,
        medium=KE.MEDIUM_GPU, lora_name=None, group_idx=0)
    base.update(kw)
    return KE.BlockStored(**base)


TS = 1767225600.25

CASES = [
    ("stored_int_parent_none",
     "BlockStored, first block of a prompt (parent_block_hash None), int hashes; "
     "shape emitted by BlockPool.cache_full_blocks (group_idx=0, defaults omitted)",
     [stored([H[0]], None, TOKENS[:BS])], None),
    ("stored_int_parent_set",
     "BlockStored of blocks 1..2 with parent_block_hash = hash of block 0, int hashes",
     [stored(H[1:3], H[0], TOKENS[BS:3 * BS])], None),
    ("stored_bytes_parent_none",
     "BlockStored with raw 32-byte sha256 hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), "
     "parent None, all 3 blocks",
     [stored(H, None, TOKENS[:3 * BS], use_int=False)], None),
    ("stored_bytes_parent_set",
     "BlockStored with raw bytes hashes and parent_block_hash as raw bytes",
     [stored(H[1:2], H[0], TOKENS[BS:2 * BS], use_int=False)], None),
    ("stored_lora",
     "BlockStored for a LoRA request: lora_id=adapter_id (7), lora_name, and "
     "extra_keys (untagged per-block, from to_event_extra_keys) ",
     [stored(HL, None, TOKENS_L, lora_id=7, lora_name="my-lora",
             extra_keys=KCU.to_event_extra_keys(
                 [(("lora", "my-lora", "/adapters/my-lora"),)] * 2))], None),
    ("stored_medium_cpu",
     "BlockStored with medium 'CPU' as the CPU offload manager emits it "
     "(kv_cache_spec_kind, kv_cache_spec_sliding_window None, locality LOCAL)",
     [stored([H[0]], None, TOKENS[:BS], medium=KE.MEDIUM_CPU,
             kv_cache_spec_kind="full_attention", locality="LOCAL")], None),
    ("stored_all_fields",
     "BlockStored with every optional field set, to show full map key order",
     [stored([H[0]], None, TOKENS[:BS], lora_id=7, lora_name="my-lora",
             medium=KE.MEDIUM_STORAGE,
             extra_keys=[("my-lora", ("mmhash-abc", 5), "salt-1")],
             group_idx=1, kv_cache_spec_kind="sliding_window",
             kv_cache_spec_sliding_window=4096, locality="REMOTE",
             ownership="kvcr", session_id="sess-1",
             lookahead_token_ids=[[TOKENS[BS]]])], None),
    ("stored_minimal_no_defaults",
     "BlockStored with all defaulted fields left at None (group_idx omitted too); "
     "required fields lora_id/medium/lora_name/parent_block_hash still present as nil",
     [KE.BlockStored(block_hashes=[ext(H[0], True)], parent_block_hash=None,
                     token_ids=TOKENS[:BS], block_size=BS, lora_id=None,
                     medium=None, lora_name=None)], None),
    ("removed",
     "BlockRemoved as emitted by BlockPool eviction (one hash, medium GPU, group_idx 0)",
     [KE.BlockRemoved(block_hashes=[ext(H[2], True)], medium=KE.MEDIUM_GPU,
                      group_idx=0)], None),
    ("removed_minimal",
     "BlockRemoved with group_idx/locality/ownership at default (omitted), medium None",
     [KE.BlockRemoved(block_hashes=[ext(H[1], True), ext(H[2], True)], medium=None)], None),
    ("all_cleared", "AllBlocksCleared (reset_prefix_cache)", [KE.AllBlocksCleared()], None),
    ("dp_rank_explicit",
     "KVEventBatch with data_parallel_rank=3 set by the producer (publisher keeps it)",
     [stored([H[0]], None, TOKENS[:BS])], 3),
    ("dp_rank_unset",
     "KVEventBatch with data_parallel_rank=None: ZmqEventPublisher.publish() fills in "
     "its own rank (0) before encoding, so the wire shows 0",
     [stored([H[0]], None, TOKENS[:BS])], None),
    ("multi_event_batch",
     "One batch with several events: stored(int) x2, removed, all_cleared",
     [stored([H[0]], None, TOKENS[:BS]), stored(H[1:3], H[0], TOKENS[BS:3 * BS]),
      KE.BlockRemoved(block_hashes=[ext(H[2], True)], medium=KE.MEDIUM_GPU, group_idx=0),
      KE.AllBlocksCleared()], None),
    ("stored_int_hash_above_2_63",
     f"BlockStored whose real sha256 block hash has int form >= 2**63 "
     f"(msgpack uint64 0xcf); token_ids = [(i*31+{salt}) % 152064 for i in range(16)]",
     [stored([h_big], None, toks_big)], None),
]


def warm_up(pub, sub):
    """PUB/SUB slow joiner: a SUB subscription reaches the PUB asynchronously and
    anything published earlier is dropped (the machine is heavily loaded).  Publish
    empty batches through the real publisher until one arrives, drain, then reset
    the publisher's sequence counter and replay buffer so fixtures start at seq 0."""
    for _ in range(60):
        pub.publish(KE.KVEventBatch(ts=0.0, events=[]))
        if sub.poll(500):
            break
    else:
        raise TimeoutError("subscriber never connected")
    while not pub._event_queue.empty():
        time.sleep(0.1)
    time.sleep(0.5)
    while sub.poll(200):
        sub.recv_multipart()
    pub._seq_gen = itertools.count()
    pub._buffer.clear()


def recv(sock, timeout_ms=15000):
    if not sock.poll(timeout_ms):
        raise TimeoutError("no message")
    return sock.recv_multipart()


def decode(payload):
    generic = msgspec.msgpack.decode(payload)
    typed = msgspec.msgpack.decode(payload, type=KE.KVEventBatch)
    return jsonable(generic), jsonable(msgspec.to_builtins(typed, enc_hook=None))


def frame_record(frames):
    return [f.hex() for f in frames]


def main():
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")
    port = int(sub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    with socket.socket() as probe:  # free port for the replay ROUTER
        probe.bind(("127.0.0.1", 0))
        rport = probe.getsockname()[1]

    pub = KE.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{rport}", topic="")
    warm_up(pub, sub)

    out_cases = []
    for i, (name, desc, events, dp) in enumerate(CASES):
        batch = KE.KVEventBatch(ts=TS + i, events=events, data_parallel_rank=dp)
        pub.publish(batch)
        frames = recv(sub)
        assert int.from_bytes(frames[1], "big") == i, "unexpected seq"
        generic, typed = decode(frames[2])
        out_cases.append({
            "name": name, "description": desc,
            "publisher": {"data_parallel_rank": 0, "topic": ""},
            "frames_hex": frame_record(frames),
            "seq": int.from_bytes(frames[1], "big"),
            "decoded_wire": generic, "decoded_typed": typed,
        })

    # Replay protocol through the real ROUTER socket.
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{rport}")
    start = len(CASES) - 2
    req = [b"", start.to_bytes(8, "big")]
    dealer.send_multipart(req)
    replies = []
    while True:
        fr = recv(dealer)
        replies.append(frame_record(fr))
        if fr[2] == KE.ZmqEventPublisher.END_SEQ:
            break
    dealer.close(linger=0)
    pub.shutdown()

    # Second publisher: dp rank 1 + non-empty topic (port is offset by the rank).
    sub2 = ctx.socket(zmq.SUB)
    sub2.setsockopt(zmq.SUBSCRIBE, b"")
    sub2.bind("tcp://127.0.0.1:*")
    port2 = int(sub2.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    pub2 = KE.ZmqEventPublisher(
        data_parallel_rank=1, endpoint=f"tcp://127.0.0.1:{port2 - 1}", topic="kv-events")
    warm_up(pub2, sub2)
    pub2.publish(KE.KVEventBatch(ts=TS + 100, events=[stored([H[0]], None, TOKENS[:BS])]))
    frames = recv(sub2)
    generic, typed = decode(frames[2])
    out_cases.append({
        "name": "dp_rank1_publisher_with_topic",
        "description": "ZmqEventPublisher(data_parallel_rank=1, topic='kv-events'): "
                       "endpoint port base+1, batch rank None -> 1; seq restarts at 0 per publisher",
        "publisher": {"data_parallel_rank": 1, "topic": "kv-events"},
        "frames_hex": frame_record(frames),
        "seq": int.from_bytes(frames[1], "big"),
        "decoded_wire": generic, "decoded_typed": typed,
    })
    pub2.shutdown()
    sub.close(linger=0)
    sub2.close(linger=0)

    # Not sent: what msgspec does with data_parallel_rank=None (array_like
    # ignores omit_defaults -> trailing nil is still encoded).
    enc = msgspec.msgpack.Encoder()
    p = enc.encode(KE.KVEventBatch(ts=TS, events=[KE.AllBlocksCleared()]))
    direct = {
        "name": "direct_encode_dp_rank_none",
        "description": "NOT via the publisher: msgspec.msgpack.Encoder().encode of a "
                       "KVEventBatch with data_parallel_rank=None. array_like structs do "
                       "not omit defaults, so the array still has 3 elements (nil last)",
        "payload_hex": p.hex(),
        "decoded_wire": jsonable(msgspec.msgpack.decode(p)),
    }

    doc = {
        "generator": "make_event_fixtures.py (real vLLM 0.33.0 ZmqEventPublisher)",
        "msgspec_version": msgspec.__version__, "pyzmq_version": zmq.__version__,
        "notes": [
            "frames_hex = [topic, seq (8-byte big-endian unsigned), msgpack payload]",
            "decoded_wire = schema-less msgpack decode; decoded_typed = msgspec decode "
            "into KVEventBatch then to_builtins (shows defaults); bytes as {'$bytes': hex}",
            "hash algo sha256 (pickle), PYTHONHASHSEED unset -> NONE_HASH seed 'vllm-none-hash'",
            "batch ts are fixed values (vLLM uses time.time())",
        ],
        "real_block_hashes": {
            "token_ids": TOKENS, "block_size": BS,
            "hashes_hex": [h.hex() for h in H],
            "hashes_int": [ext(h, True) for h in H],
            "lora_token_ids": TOKENS_L, "lora": "my-lora @ /adapters/my-lora",
            "lora_hashes_hex": [h.hex() for h in HL],
            "big_hash_hex": h_big.hex(), "big_hash_int": ext(h_big, True),
        },
        "cases": out_cases,
        "encoder_only": [direct],
        "replay": {
            "description": "DEALER connects to the publisher's ROUTER replay endpoint and "
                           "sends [b'', start_seq 8-byte BE]. Publisher (ROUTER) sends "
                           "[client_id, b'', topic, seq, payload] per buffered batch with "
                           "seq >= start_seq, then [client_id, b'', b'', END_SEQ, b''] "
                           "with END_SEQ = (-1).to_bytes(8,'big',signed=True) = ff*8. "
                           "Frames below are as received by the DEALER (identity stripped).",
            "request_frames_hex": frame_record(req),
            "start_seq": start,
            "reply_messages_hex": replies,
        },
    }
    with open(os.path.join(HERE, "event_fixtures.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote event_fixtures.json: {len(out_cases)} cases, {len(replies)} replay msgs")


if __name__ == "__main__":
    main()
