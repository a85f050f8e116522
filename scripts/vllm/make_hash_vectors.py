#!/usr/bin/env python3
"""Golden prefix-cache block-hash vectors from the real vLLM 0.33.0 wheel.

Usage (see scripts/vllm/README.md):  VLLM_WHEEL=<vllm-0.33.0 wheel> <venv>/bin/python scripts/vllm/make_hash_vectors.py
Writes: hash_vectors.json beside this script

Nothing is reimplemented: hashes come from vLLM's own
  vllm.utils.hashing.get_hash_fn_by_name(algo)
  vllm.v1.core.kv_cache_utils.init_none_hash / get_request_block_hasher /
  maybe_convert_block_hash / to_event_extra_keys
loaded from the wheel by vllm_wheel_loader.py (see there for the stubs).
Each PYTHONHASHSEED setting runs in its own subprocess (the env var is read by
init_none_hash).  The hashed object of every block is captured by wrapping the
hash function passed to get_request_block_hasher; its serialized preimage
(pickle.dumps(obj, HIGHEST_PROTOCOL) or cbor2.dumps(obj, canonical=True), as in
hashing.py) is stored too and re-checked against the real digest.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "hash_vectors.json")

# PYTHONHASHSEED settings; None = variable unset.
SEEDS = [None, "0", "1234"]
ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
# xxhash* with PYTHONHASHSEED unset uses os.urandom -> not reproducible.
NON_CRYPTO = {"xxhash", "xxhash_cbor"}

LORA = {"lora_name": "my-lora", "lora_path": "/adapters/my-lora", "lora_int_id": 7}

# Token values chosen to hit every pickle int opcode (BININT1/BININT2/BININT)
# and CBOR uint width (immediate, 1, 2, 4 bytes).
EDGE = [0, 1, 23, 24, 255, 256, 65535, 65536, 128000, 151643, 2147483647, 5, 42, 1000, 31999, 7]


def tokens(n: int, salt: int = 0) -> list[int]:
    out = []
    for i in range(n):
        if salt == 0 and i < len(EDGE):
            out.append(EDGE[i])
        else:
            out.append((i * 7919 + 13 + salt * 104729) % 152064)
    return out


def case_specs():
    S = []

    def add(name, bs, n, **kw):
        S.append(dict(name=name, block_size=bs, n_tokens=n, **kw))

    add("bs16_1block", 16, 16)
    add("bs16_2blocks", 16, 32)
    add("bs16_3blocks_plus_partial5", 16, 53)
    add("bs16_partial_only10", 16, 10)
    add("bs32_3blocks_plus_partial7", 32, 103)
    add("bs32_1block_plus_partial31", 32, 63)
    add("bs64_3blocks_plus_partial8", 64, 200)
    add("bs16_lora_2blocks_plus_partial3", 16, 35, lora=True)
    add("bs32_lora_3blocks_plus_partial1", 32, 97, lora=True)
    add("bs16_cache_salt_2blocks_plus_partial4", 16, 36, cache_salt="tenant-a")
    add("bs16_mm_3blocks", 16, 48,
        mm=[{"identifier": "mmhash-abc123", "offset": 5, "length": 20}])
    add("bs16_lora_mm_salt_3blocks_plus_partial2", 16, 50, lora=True,
        cache_salt="s1",
        mm=[{"identifier": "img-0", "offset": 0, "length": 16},
            {"identifier": "img-1", "offset": 20, "length": 4}])
    # two mm items in one block: the interned "mm" literal is pickled once and
    # then referenced via BINGET in the sha256/xxhash (pickle) preimage.
    add("bs16_two_mm_in_block0_2blocks", 16, 32,
        mm=[{"identifier": "img-a", "offset": 0, "length": 4},
            {"identifier": "img-b", "offset": 6, "length": 4}])
    return S


def jsonable(x):
    if isinstance(x, bytes):
        return {"$bytes": x.hex()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def worker():
    sys.path.insert(0, HERE)
    import cbor2

    import vllm_wheel_loader

    v = vllm_wheel_loader.load()
    kcu, hashing = v.kcu, v.hashing
    seed = os.environ.get("PYTHONHASHSEED")
    res = {"none_hashes": [], "cases": []}
    for algo in ALGOS:
        if seed is None and algo in NON_CRYPTO:
            continue
        fn = hashing.get_hash_fn_by_name(algo)
        kcu.init_none_hash(fn)
        none_hash = kcu.NONE_HASH
        seed_used = kcu.get_none_hash_seed()
        ser = ((lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL))
               if algo in ("sha256", "xxhash")
               else (lambda o: cbor2.dumps(o, canonical=True)))
        assert fn(seed_used) == none_hash
        res["none_hashes"].append({
            "algo": algo, "pythonhashseed": seed, "seed_string": seed_used,
            "preimage_hex": ser(seed_used).hex(), "none_hash_hex": none_hash.hex(),
        })
        for spec in case_specs():
            captured = []

            def capture(obj, _fn=fn):
                captured.append(obj)
                return _fn(obj)

            toks = tokens(spec["n_tokens"])
            lora = None
            if spec.get("lora"):
                lora = types.SimpleNamespace(
                    lora_name=LORA["lora_name"], lora_path=LORA["lora_path"],
                    name=LORA["lora_name"], adapter_id=LORA["lora_int_id"])
            mm = [types.SimpleNamespace(
                identifier=m["identifier"],
                mm_position=types.SimpleNamespace(offset=m["offset"], length=m["length"]))
                for m in spec.get("mm", [])]
            req = types.SimpleNamespace(
                block_hashes=[], num_tokens=len(toks), all_token_ids=toks,
                mm_features=mm, lora_request=lora,
                cache_salt=spec.get("cache_salt"), prompt_embeds=None)
            hasher = kcu.get_request_block_hasher(spec["block_size"], capture)
            hashes = hasher(req)
            assert len(hashes) == len(toks) // spec["block_size"] == len(captured)
            blocks = []
            os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
            for i, (h, obj) in enumerate(zip(hashes, captured)):
                pre = ser(obj)
                assert fn(obj) == h
                as_int = kcu.maybe_convert_block_hash(h)
                blocks.append({
                    "index": i,
                    "token_range": [i * spec["block_size"], (i + 1) * spec["block_size"]],
                    "parent_hash_hex": obj[0].hex(),
                    "extra_keys": jsonable(obj[2]),
                    "preimage_hex": pre.hex(),
                    "hash_hex": h.hex(),
                    "hash_int": as_int,
                    "hash_int_str": str(as_int),
                })
            os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
            assert all(kcu.maybe_convert_block_hash(h) == h for h in hashes)
            res["cases"].append({
                "name": f"{algo}/{'seed=' + seed if seed is not None else 'unseeded'}/{spec['name']}",
                "algo": algo,
                "block_size": spec["block_size"],
                "seed": seed,
                "none_hash_hex": none_hash.hex(),
                "lora_name": LORA["lora_name"] if lora else None,
                "lora_path": LORA["lora_path"] if lora else None,
                "cache_salt": spec.get("cache_salt"),
                "mm_features": spec.get("mm", []),
                "token_ids": toks,
                "num_full_blocks": len(hashes),
                "partial_tail_tokens": len(toks) % spec["block_size"],
                "event_extra_keys": jsonable(
                    kcu.to_event_extra_keys([o[2] for o in captured])),
                "block_hashes_hex": [h.hex() for h in hashes],
                "block_hashes_int": [b["hash_int"] for b in blocks],
                "blocks": blocks,
            })
    json.dump(res, sys.stdout)


def main():
    all_none, all_cases = [], []
    for seed in SEEDS:
        env = dict(os.environ)
        env.pop("PYTHONHASHSEED", None)
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"],
                             env=env, check=True, capture_output=True, text=True).stdout
        r = json.loads(out)
        all_none += r["none_hashes"]
        all_cases += r["cases"]
    doc = {
        "generator": "make_hash_vectors.py (real vLLM 0.33.0 code from the wheel)",
        "python": sys.version.split()[0],
        "pickle_protocol": pickle.HIGHEST_PROTOCOL,
        "notes": [
            "hash = H(serialize((parent_hash_bytes, tuple(block_token_ids), extra_keys_or_None)))",
            "parent of block 0 is NONE_HASH = H(serialize(seed_string))",
            "hash_int = int.from_bytes(digest, 'big') & (2**64-1) (last 8 digest bytes, big-endian, unsigned)",
            "partial last block never hashed; num_full_blocks = len(token_ids) // block_size",
            "extra_keys JSON: tuples as arrays, bytes as {'$bytes': hex}",
            "xxhash/xxhash_cbor only with PYTHONHASHSEED set (unset -> random seed)",
        ],
        "none_hashes": all_none,
        "cases": all_cases,
    }
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {OUT}: {len(all_cases)} cases, {len(all_none)} none hashes")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
