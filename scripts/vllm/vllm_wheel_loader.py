"""Load the *real* vLLM 0.33.0 modules needed for KV events / block hashing
straight out of the wheel, with the smallest possible set of stub modules.

Real code (executed from the wheel, sha256-checked against the wheel RECORD):
    vllm/envs.py                      (stdlib-only at import time)
    vllm/utils/hashing.py             (sha256, sha256_cbor, xxhash, xxhash_cbor)
    vllm/v1/core/kv_cache_utils.py    (NONE_HASH, hash_block_tokens,
                                       get_request_block_hasher, maybe_convert_block_hash, ...)
    vllm/config/kv_events.py          (KVEventsConfig)
    vllm/distributed/kv_events.py     (msgspec structs + ZmqEventPublisher)

Stubbed (never used on the code paths we exercise; they only pull torch /
pydantic / psutil / the whole engine):
    vllm (package shell), vllm.logger (-> logging), vllm.config (VllmConfig),
    vllm.config.utils (config -> dataclasses.dataclass), vllm.multimodal.utils,
    vllm.utils.math_utils, vllm.utils.network_utils, vllm.v1.kv_cache_interface,
    vllm.v1.kv_cache_spec_registry, vllm.v1.request, vllm.v1.utils
Third-party deps that are real: msgspec, cbor2, pyzmq, xxhash (from the venv).
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import hashlib
import io
import logging
import os
import sys
import types
import zipfile

WHEEL = os.environ.get(
    "VLLM_WHEEL", "/tmp/vllm/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
)

REAL_MODULES = [
    ("vllm.envs", "vllm/envs.py"),
    ("vllm.utils.hashing", "vllm/utils/hashing.py"),
    ("vllm.v1.core.kv_cache_utils", "vllm/v1/core/kv_cache_utils.py"),
    ("vllm.config.kv_events", "vllm/config/kv_events.py"),
    ("vllm.distributed.kv_events", "vllm/distributed/kv_events.py"),
]

STUBBED_MODULES: list[str] = []


class _Placeholder:
    """Stand-in for classes/functions of stubbed modules; fails loudly if used."""

    def __init__(self, *a, **k):
        raise RuntimeError(f"stubbed vLLM object {type(self).__name__} was used")


def _placeholder(name: str):
    return type(name, (_Placeholder,), {})


def _stub(modname: str, package: bool = False, **attrs):
    mod = types.ModuleType(modname)
    if package:
        mod.__path__ = []  # make it a package so submodules can be attached
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[modname] = mod
    if "." in modname:
        parent, _, child = modname.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)
    STUBBED_MODULES.append(modname)
    return mod


def _record_hashes(zf: zipfile.ZipFile) -> dict[str, str]:
    rec = zf.read("vllm-0.33.0.dist-info/RECORD").decode()
    out = {}
    for row in csv.reader(io.StringIO(rec)):
        if len(row) >= 2 and row[1].startswith("sha256="):
            out[row[0]] = row[1][len("sha256="):]
    return out


def _load_real(zf, records, modname, path):
    src = zf.read(path)
    digest = base64.urlsafe_b64encode(hashlib.sha256(src).digest()).rstrip(b"=").decode()
    if records.get(path) != digest:
        raise RuntimeError(f"{path}: sha256 does not match wheel RECORD")
    mod = types.ModuleType(modname)
    mod.__file__ = f"{WHEEL}/{path}"
    mod.__package__ = modname.rpartition(".")[0]
    sys.modules[modname] = mod
    parent, _, child = modname.rpartition(".")
    setattr(sys.modules[parent], child, mod)
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


_LOADED = None


def load():
    """Returns a namespace with the real modules: envs, hashing, kcu, kv_events."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    if "vllm" in sys.modules:
        raise RuntimeError("a real vllm package is already imported")

    # Package shells.
    for pkg in ["vllm", "vllm.utils", "vllm.v1", "vllm.v1.core",
                "vllm.distributed", "vllm.multimodal"]:
        _stub(pkg, package=True)

    # Leaf stubs.
    _stub("vllm.logger", init_logger=lambda name: logging.getLogger(name))
    _stub("vllm.config", package=True, VllmConfig=_placeholder("VllmConfig"))
    # real decorator is a pydantic dataclass wrapper (needs torch+pydantic)
    _stub("vllm.config.utils", config=lambda cls: dataclasses.dataclass(cls))
    _stub("vllm.multimodal.utils",
          get_mm_features_in_window=_placeholder("get_mm_features_in_window"))
    _stub("vllm.utils.math_utils", cdiv=lambda a, b: -(a // -b))
    _stub("vllm.v1.kv_cache_interface",
          **{n: _placeholder(n) for n in ["KVCacheConfig", "KVCacheGroupSpec",
                                          "KVCacheSpec", "MambaSpec",
                                          "UniformTypeKVCacheSpecs"]},
          iter_layer_specs=_placeholder("iter_layer_specs"))
    _stub("vllm.v1.kv_cache_spec_registry",
          KVCacheSpecRegistry=_placeholder("KVCacheSpecRegistry"))
    _stub("vllm.v1.request", Request=_placeholder("Request"))
    _stub("vllm.v1.utils", tensor_data=_placeholder("tensor_data"))
    # only used for the 'tcp://*:0' auto-bind path, which we never use
    _stub("vllm.utils.network_utils",
          **{n: _placeholder(n) for n in ["get_ip", "get_tcp_uri",
                                          "is_valid_ipv6_address",
                                          "split_zmq_path"]})

    with zipfile.ZipFile(WHEEL) as zf:
        records = _record_hashes(zf)
        mods = {m: _load_real(zf, records, m, p) for m, p in REAL_MODULES}

    _LOADED = types.SimpleNamespace(
        envs=mods["vllm.envs"],
        hashing=mods["vllm.utils.hashing"],
        kcu=mods["vllm.v1.core.kv_cache_utils"],
        kv_events_config=mods["vllm.config.kv_events"],
        kv_events=mods["vllm.distributed.kv_events"],
        stubbed=list(STUBBED_MODULES),
        real=[p for _, p in REAL_MODULES],
    )
    return _LOADED
