//! The block table's rebuild alone: an index of N distinct blocks (REPORTs of 4,096 random
//! hashes, over 100 workers) is asked for a table with room for more (`Index::table_for`); the
//! table is dropped untimed, and this is done 7 times. Prints each rebuild's time, the median
//! and its time per entry. This is what a writer's table growth costs (see `table.rs`).
//!
//! Usage: `cargo bench -p kv-index --bench rebuild [-- BLOCKS] [--doubling | --fill]` (default
//! 5,000,000 blocks, room for as many again); pin it to a core (`taskset -c 1`) to compare
//! builds. `--doubling` asks for one entry more than the table has room for: the next
//! doubling, which a table with few stale entries makes from its own slots. `--fill` asks for
//! room for three times as many again: a table four times the size, filled from the live
//! blocks. Room for as many again is a doubling at some sizes (5 M) and a fill at others.

use std::time::{Duration, Instant};

use kv_index::{ActionKind, ActionRequest, ApplyRequest, Index, Tier};

const PER_REPORT: usize = 4096;
const ROUNDS: usize = 7;

fn main() {
    let blocks: usize = std::env::args()
        .skip(1)
        .find(|arg| !arg.starts_with('-'))
        .map_or(5_000_000, |arg| arg.parse().expect("BLOCKS: a number"));
    let mode = std::env::args().find(|arg| arg.starts_with("--"));
    let index = index_of(blocks);
    let blocks = index.stats().blocks;
    let slots = index.table_memory().len() / 8;
    let room = match mode.as_deref() {
        // One more entry than the table has room for (at most 4/5 full).
        Some("--doubling") => (slots * 4 / 5 + 1).saturating_sub(index.table_entries()),
        Some("--fill") => 3 * blocks,
        None => blocks,
        Some(other) => panic!("{other}: not --doubling or --fill"),
    };
    let mut times: Vec<Duration> = (0..ROUNDS)
        .map(|_| {
            let start = Instant::now();
            let table = index.table_for(room).expect("that room rebuilds");
            let took = start.elapsed();
            drop(table);
            took
        })
        .collect();
    let ms = |t: &Duration| format!("{:.1}", t.as_secs_f64() * 1e3);
    println!(
        "{blocks} blocks: rebuilds (ms) {}",
        times.iter().map(ms).collect::<Vec<_>>().join(" ")
    );
    times.sort();
    let median = times[ROUNDS / 2];
    println!(
        "median {} ms, {:.1} ns per entry",
        ms(&median),
        median.as_secs_f64() * 1e9 / blocks as f64
    );
}

/// An index of at least `blocks` distinct random blocks, its table grown as a writer grows it.
fn index_of(blocks: usize) -> Index {
    let mut index = Index::new();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for report in 0..blocks.div_ceil(PER_REPORT) {
        let hashes = (0..PER_REPORT)
            .map(|_| {
                // xorshift64*: distinct, evenly spread hashes.
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                state.wrapping_mul(0x2545_F491_4F6C_DD1D) as i64
            })
            .collect();
        let apply = ApplyRequest {
            worker_id: format!("worker-{}", report % 100),
            actions: vec![ActionRequest {
                action_type: ActionKind::Report as i32,
                tier: Tier::Hbm.wire(),
                hashes,
                ..Default::default()
            }],
            ..Default::default()
        }
        .validate()
        .expect("a valid REPORT");
        if let Some(table) = index.table_for(PER_REPORT) {
            index.install_table(table).expect("built from this index");
        }
        index.apply(&apply);
    }
    index
}
