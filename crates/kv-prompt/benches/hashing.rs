//! Block hashing throughput: a 32k-token prompt hashed repeatedly into 16-token pages, plain
//! and bigram, unsalted and salted. Plain `Instant` timing; prints tokens/s and hashes/s.
//!
//! `cargo bench -p kv-indexer-client --bench hashing [-- SECONDS]` (default 2 s per case).

use std::hint::black_box;
use std::time::{Duration, Instant};

use kv_prompt::hashing::{HashConfig, hash_into};
use kv_prompt::tokenize::simple_tokenize;

const PROMPT_TOKENS: u64 = 32 * 1024;

struct Case {
    name: &'static str,
    config: HashConfig,
    salt: Option<&'static str>,
}

fn main() {
    let seconds: f64 = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(2.0);
    let budget = Duration::from_secs_f64(seconds);
    // Token ids spread like a real vocabulary's (below 2^31, so pages are hashed as u32s).
    let text: String = (0..PROMPT_TOKENS)
        .map(|i| format!("w{} ", i % 50_257))
        .collect();
    let tokens = simple_tokenize(&text);
    let cases = [
        Case {
            name: "16-token pages",
            config: HashConfig {
                block_size: 16,
                bigram: false,
            },
            salt: None,
        },
        Case {
            name: "16-token pages, salted",
            config: HashConfig {
                block_size: 16,
                bigram: false,
            },
            salt: Some("tenant-42"),
        },
        Case {
            name: "16-token pages, bigram",
            config: HashConfig {
                block_size: 16,
                bigram: true,
            },
            salt: None,
        },
        Case {
            name: "1-token pages",
            config: HashConfig {
                block_size: 1,
                bigram: false,
            },
            salt: None,
        },
    ];
    println!(
        "block hashing, {}-token prompt, {:.1} s per case",
        tokens.len(),
        budget.as_secs_f64()
    );
    println!(
        "{:<24} {:>10} {:>14} {:>14} {:>12}",
        "case", "prompts", "hashes/s", "tokens/s", "µs/prompt"
    );
    let mut hashes = Vec::new();
    for case in &cases {
        // Warm up, then time whole prompts until the budget is spent.
        hash_into(&tokens, case.config, case.salt, &mut hashes);
        let per_prompt = hashes.len();
        let start = Instant::now();
        let mut prompts = 0u64;
        while start.elapsed() < budget {
            hash_into(black_box(&tokens), case.config, case.salt, &mut hashes);
            black_box(&hashes);
            prompts += 1;
        }
        let elapsed = start.elapsed().as_secs_f64();
        println!(
            "{:<24} {:>10} {:>14.0} {:>14.0} {:>12.1}",
            case.name,
            prompts,
            (prompts as f64 * per_prompt as f64) / elapsed,
            (prompts as f64 * tokens.len() as f64) / elapsed,
            elapsed * 1e6 / prompts as f64
        );
    }
}
