//! Decode (+ map + split) throughput over the real fixture payloads and synthetic large batches.
//!
//! `cargo bench -p kv-events --bench decode`. Plain `Instant` timing: each workload runs whole
//! rounds until a time budget is spent, and reports hashes/s, batches/s and per-batch latency.

#[path = "../tests/events/common/mod.rs"]
mod common;

use common::{Mp, arr, map, rows, s, unhex};
use kv_events::{Event, decode_batch, map_events, split};
use kv_index::Tier;
use std::hint::black_box;
use std::time::{Duration, Instant};

const BUDGET: Duration = Duration::from_millis(1500);

#[derive(Clone, Copy)]
enum Stage {
    Decode,
    DecodeMap,
    DecodeMapSplit,
}

fn hashes_in(payload: &[u8]) -> usize {
    decode_batch(payload)
        .unwrap()
        .events
        .iter()
        .map(|event| match event {
            Event::BlockStored(stored) => stored.block_hashes.len(),
            Event::BlockRemoved { block_hashes, .. } => block_hashes.len(),
            Event::AllBlocksCleared => 0,
        })
        .sum()
}

fn run(stage: Stage, payload: &[u8]) {
    let batch = decode_batch(black_box(payload)).unwrap();
    match stage {
        Stage::Decode => {
            black_box(batch);
        }
        Stage::DecodeMap => {
            black_box(map_events(&batch.events, &Tier::ALL));
        }
        Stage::DecodeMapSplit => {
            black_box(split(map_events(&batch.events, &Tier::ALL)));
        }
    }
}

fn bench(name: &str, stage: Stage, payloads: &[Vec<u8>]) {
    let hashes: usize = payloads.iter().map(|p| hashes_in(p)).sum();
    let bytes: usize = payloads.iter().map(Vec::len).sum();
    for payload in payloads {
        run(stage, payload); // warm-up
    }
    let mut per_batch = Vec::new();
    let mut rounds = 0u64;
    let start = Instant::now();
    while start.elapsed() < BUDGET {
        for payload in payloads {
            let t = Instant::now();
            run(stage, payload);
            per_batch.push(t.elapsed());
        }
        rounds += 1;
    }
    let elapsed = start.elapsed().as_secs_f64();
    per_batch.sort_unstable();
    let pct = |q: f64| per_batch[((per_batch.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    println!(
        "{name:<44} {:>7.1} M hashes/s {:>9.0} batches/s {:>7.1} MB/s   per batch p50 {:>7.2} µs p99 {:>7.2} µs   ({rounds} rounds of {} batches, {hashes} hashes, {bytes} bytes)",
        (hashes as u64 * rounds) as f64 / elapsed / 1e6,
        (payloads.len() as u64 * rounds) as f64 / elapsed,
        (bytes as u64 * rounds) as f64 / elapsed / 1e6,
        pct(0.5),
        pct(0.99),
        payloads.len(),
    );
}

fn fixture_payloads(file: &str) -> Vec<Vec<u8>> {
    rows(file)
        .iter()
        .map(|row| unhex(row["payload_hex"].as_str().unwrap()))
        .collect()
}

/// 64 chained `BlockStored` of 256 u64 hashes each (page size 1: one token per hash), GPU.
fn synthetic(map_era: bool) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state | (1 << 63) // always the 9-byte uint64 form, as msgspec writes big hashes
    };
    let mut parent = Mp::Nil;
    let mut events = Vec::new();
    for _ in 0..64 {
        let hashes: Vec<u64> = (0..256).map(|_| next()).collect();
        let tokens = arr((0..256).map(|t| Mp::Int(1000 + t)));
        let hash_list = arr(hashes.iter().map(|h| Mp::U64(*h)));
        events.push(if map_era {
            map([
                ("type", s("BlockStored")),
                ("block_hashes", hash_list),
                ("parent_block_hash", parent.clone()),
                ("token_ids", tokens),
                ("block_size", Mp::Int(1)),
                ("lora_id", Mp::Nil),
                ("medium", s("GPU")),
            ])
        } else {
            arr([
                s("BlockStored"),
                hash_list,
                parent.clone(),
                tokens,
                Mp::Int(1),
                Mp::Nil,
                s("GPU"),
            ])
        });
        parent = Mp::U64(*hashes.last().unwrap());
    }
    arr([Mp::F64(1_750_000_000.0), Mp::Arr(events), Mp::Int(0)]).encode()
}

fn main() {
    // `cargo test --benches` runs this with `--bench` absent: keep that a quick smoke run.
    if !std::env::args().any(|arg| arg == "--bench") {
        let payload = synthetic(true);
        assert_eq!(
            map_events(&decode_batch(&payload).unwrap().events, &[]).len(),
            1
        );
        return;
    }
    let threads = std::thread::available_parallelism().map_or(0, usize::from);
    println!("kv-events decode bench ({threads} hardware threads, single-threaded)");
    let map_era = fixture_payloads("sglang-events-0.5.23.jsonl");
    let array_era = fixture_payloads("sglang-events-0.5.18.jsonl");
    bench("fixtures 0.5.23 (map era): decode", Stage::Decode, &map_era);
    bench(
        "fixtures 0.5.23 (map era): decode+map",
        Stage::DecodeMap,
        &map_era,
    );
    bench(
        "fixtures 0.5.23 (map era): decode+map+split",
        Stage::DecodeMapSplit,
        &map_era,
    );
    bench(
        "fixtures 0.5.18 (array era): decode",
        Stage::Decode,
        &array_era,
    );
    bench(
        "fixtures 0.5.18 (array era): decode+map",
        Stage::DecodeMap,
        &array_era,
    );
    let large_map = vec![synthetic(true)];
    let large_array = vec![synthetic(false)];
    bench(
        "synthetic 64x256 u64 (map era): decode",
        Stage::Decode,
        &large_map,
    );
    bench(
        "synthetic 64x256 u64 (map era): decode+map",
        Stage::DecodeMap,
        &large_map,
    );
    bench(
        "synthetic 64x256 u64 (map era): +split",
        Stage::DecodeMapSplit,
        &large_map,
    );
    bench(
        "synthetic 64x256 u64 (array era): decode+map",
        Stage::DecodeMap,
        &large_array,
    );
}
