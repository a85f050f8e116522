#!/usr/bin/env python3
"""Writes the seed corpora of the cargo-fuzz targets from the captured SGLang and vLLM fixtures.

decode_batch: every captured msgpack payload (both engines); zmq_frames: every captured multipart message,
each frame as a little-endian u32 length then its bytes; grpc_index: every payload with its
u32 length in front (the operations after it start empty). Usage: fuzz_seeds.py CORPUS_DIR
"""
import json
import pathlib
import struct
import sys

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "crates/kv-testkit/fixtures"


def prefixed(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def main() -> None:
    corpus = pathlib.Path(sys.argv[1])
    seeds = {"decode_batch": [], "zmq_frames": [], "grpc_index": []}
    for path in sorted(FIXTURES.glob("sglang-events-*.jsonl")):
        for line in path.read_text().splitlines():
            payload = bytes.fromhex(json.loads(line)["payload_hex"])
            seeds["decode_batch"].append(payload)
            seeds["grpc_index"].append(prefixed(payload))
    for line in (FIXTURES / "zmq-frames-0.5.23.jsonl").read_text().splitlines():
        frames = [bytes.fromhex(f) for f in json.loads(line)["frames_hex"]]
        seeds["zmq_frames"].append(b"".join(prefixed(f) for f in frames))
    vllm = json.loads((FIXTURES / "vllm-events-0.33.0.json").read_text())
    for case in vllm["cases"]:
        frames = [bytes.fromhex(f) for f in case["frames_hex"]]
        seeds["decode_batch"].append(frames[2])
        seeds["zmq_frames"].append(b"".join(prefixed(f) for f in frames))
    for target, inputs in seeds.items():
        directory = corpus / target
        directory.mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(inputs):
            (directory / f"seed-{i:04}").write_bytes(data)
        print(f"{target}: {len(inputs)} seeds in {directory}")


if __name__ == "__main__":
    main()
