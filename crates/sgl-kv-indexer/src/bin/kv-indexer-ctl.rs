//! `kv-indexer-ctl`: an operator's view of a running Indexer, through the router's client.
//!
//! - `hash`: token ids (or `--text`, through the built-in word tokenizer) into SGLang block
//!   hashes, offline;
//! - `prefix`: the workers holding the longest prefix of some blocks (given as hashes, or as
//!   tokens / text hashed here);
//! - `match`: every worker's exact placements of some blocks;
//! - `hits`: the blocks' cumulative hit counts;
//! - `health`: each replica's gRPC health (SERVING, or NOT_SERVING while it recovers or lags);
//!   exit 0 only when every one serves, so it is an image's or an orchestrator's health check;
//! - `state`: each replica's readiness, sizes, shared-log position and lag (`--digest` adds the
//!   index digest, which reads the whole index);
//! - `workers`: every worker the index knows: address, placements per tier, last apply;
//! - `drop`: drops a decommissioned worker's placements through the log (the write token), so
//!   every replica and every restart agrees; stop its bridge first, or its next apply is back.
//!
//! Tables by default, `--json` for scripts. Exit status: 0 when the Indexer answered (a miss
//! included), 1 when it could not (unreachable, timeout, overloaded, rejected), 2 for bad
//! arguments.

use std::fmt::Write as _;
use std::num::{NonZeroU64, NonZeroUsize};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args as ClapArgs, Parser, Subcommand};
use kv_indexer_client::hashing::{HashConfig, block_hashes};
use kv_indexer_client::{
    ClientConfig, ClientSecurity, Endpoint, HitCount, IndexerClient, MAX_PREFIX_HASHES, NodeMatch,
    PrefixOutcome, QueryError, ServerState, ServingStatus, Status, WorkerState, simple_tokenize,
};
use serde_json::{Value, json};

/// Ask a KV-cache Indexer which workers hold which blocks.
#[derive(Debug, Parser)]
#[command(name = "kv-indexer-ctl", version)]
struct Args {
    /// The Indexer: http://host:port, https://host:port or unix:path; a comma-separated list
    /// is tried in order.
    #[arg(
        long,
        global = true,
        env = "KV_INDEXER_ENDPOINT",
        default_value = "http://[::1]:50051"
    )]
    endpoint: String,
    /// Deadline of each query, in milliseconds (sent as grpc-timeout and enforced here).
    #[arg(
        long,
        global = true,
        env = "KV_INDEXER_CTL_TIMEOUT_MS",
        default_value = "5000"
    )]
    timeout_ms: NonZeroU64,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// TLS and the read (or write) token for the Indexer.
    #[command(flatten)]
    security: ClientSecurity,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Hash token ids (or text) into SGLang block hashes; needs no Indexer.
    Hash {
        #[command(flatten)]
        tokens: TokenSource,
        #[command(flatten)]
        hashing: Hashing,
    },
    /// The workers holding the longest prefix of the blocks (MatchExternalKvPrefix).
    Prefix {
        #[command(flatten)]
        blocks: Blocks,
    },
    /// Every worker's exact placements of the blocks (MatchExternalKv).
    Match {
        #[command(flatten)]
        blocks: Blocks,
        /// Count each matched block as a hit.
        #[arg(long)]
        count_as_hit: bool,
    },
    /// The blocks' cumulative hit counts (GetExternalKvHitCounts).
    Hits {
        #[command(flatten)]
        blocks: Blocks,
    },
    /// Each replica's gRPC health (grpc.health.v1); exit 0 only when every one is SERVING.
    Health,
    /// Each replica's readiness, sizes and place in the shared log; exit 0 when every one answered.
    State {
        /// Also the index digest (reads the whole index: seconds at 100 M placements).
        #[arg(long)]
        digest: bool,
    },
    /// Every worker the index knows: address, placements per tier, last apply.
    Workers,
    /// Drop a decommissioned worker's placements, through the log (needs the write token).
    Drop {
        /// The worker's id (as `workers` lists it).
        worker_id: String,
    },
}

/// How the worker's engine hashes its pages.
#[derive(Debug, Clone, ClapArgs)]
struct Hashing {
    /// Tokens per page: the worker's `kv_events.block_size`.
    #[arg(long, env = "KV_INDEXER_BLOCK_SIZE", default_value = "16")]
    block_size: NonZeroUsize,
    /// Units are token bigrams (speculative engines: EAGLE, EAGLE3, FROZEN_KV_MTP).
    #[arg(long)]
    bigram: bool,
    /// The request's cache salt.
    #[arg(long)]
    cache_salt: Option<String>,
}

impl Hashing {
    fn config(&self) -> HashConfig {
        HashConfig {
            block_size: self.block_size.get(),
            bigram: self.bigram,
        }
    }

    fn hash(&self, tokens: &[u64]) -> Vec<i64> {
        block_hashes(tokens, self.config(), self.cache_salt.as_deref())
    }
}

/// Token ids, or text to tokenize.
#[derive(Debug, Clone, ClapArgs)]
#[group(required = true, multiple = false)]
struct TokenSource {
    /// Token ids (separated by spaces or commas).
    #[arg(value_delimiter = ',')]
    tokens: Vec<u64>,
    /// Text, split into words by the built-in tokenizer (one FNV-1a token id per word).
    #[arg(long)]
    text: Option<String>,
}

impl TokenSource {
    fn token_ids(&self) -> Vec<u64> {
        match &self.text {
            Some(text) => simple_tokenize(text),
            None => self.tokens.clone(),
        }
    }
}

/// Block hashes, or tokens / text hashed with `Hashing`.
#[derive(Debug, Clone, ClapArgs)]
struct Blocks {
    #[command(flatten)]
    source: BlockSource,
    #[command(flatten)]
    hashing: Hashing,
}

#[derive(Debug, Clone, ClapArgs)]
#[group(required = true, multiple = false)]
struct BlockSource {
    /// Block hashes, signed 64-bit, in prompt order (separated by spaces or commas).
    #[arg(value_delimiter = ',', allow_negative_numbers = true)]
    hashes: Vec<i64>,
    /// Token ids to hash into blocks first.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    tokens: Option<Vec<u64>>,
    /// Text to tokenize and hash into blocks first.
    #[arg(long)]
    text: Option<String>,
}

impl Blocks {
    fn hashes(&self) -> Vec<i64> {
        match (&self.source.tokens, &self.source.text) {
            (Some(tokens), _) => self.hashing.hash(tokens),
            (None, Some(text)) => self.hashing.hash(&simple_tokenize(text)),
            (None, None) => self.source.hashes.clone(),
        }
    }
}

/// What a command prints, and whether the Indexer answered.
struct Report {
    json: Value,
    table: String,
    answered: bool,
}

impl Report {
    /// The report of a query the Indexer answered (or of a command that needs none).
    fn answered(json: Value, table: String) -> Report {
        Report {
            json,
            table,
            answered: true,
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Args = sgl_kv_indexer::parse_args();
    match run(&args).await {
        Ok(report) => {
            if args.json {
                println!("{}", report.json);
            } else if report.answered {
                print!("{}", report.table);
            } else if matches!(args.command, Command::Health | Command::State { .. }) {
                // Each line already names its replica.
                eprint!("error: {}", report.table);
            } else {
                eprintln!(
                    "error: {} (asked {})",
                    report.table.trim_end(),
                    args.endpoint
                );
            }
            if report.answered {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: &Args) -> anyhow::Result<Report> {
    let client = || -> anyhow::Result<IndexerClient> {
        let endpoints =
            Endpoint::parse_list(&args.endpoint).context("--endpoint (KV_INDEXER_ENDPOINT)")?;
        let mut config = ClientConfig::new(endpoints);
        config.query_timeout = Duration::from_millis(args.timeout_ms.get());
        config.security = args.security.clone();
        IndexerClient::new(config).context("--endpoint (KV_INDEXER_ENDPOINT)")
    };
    Ok(match &args.command {
        Command::Hash { tokens, hashing } => hash_report(&tokens.token_ids(), hashing),
        Command::Prefix { blocks } => {
            let hashes = blocks.hashes();
            let answer = client()?.longest_prefix_or_status(&hashes).await;
            prefix_report(answer.map_err(QueryError::from), hashes.len())
        }
        Command::Match {
            blocks,
            count_as_hit,
        } => match_report(client()?.match_exact(&blocks.hashes(), *count_as_hit).await),
        Command::Hits { blocks } => hits_report(client()?.hit_counts(&blocks.hashes()).await),
        Command::Health => health_report(&client()?.health().await),
        Command::State { digest } => state_report(&client()?.states(*digest).await),
        Command::Workers => workers_report(client()?.workers().await, now_ms()),
        Command::Drop { worker_id } => {
            drop_report(worker_id, client()?.drop_worker(worker_id).await)
        }
    })
}

fn hash_report(tokens: &[u64], hashing: &Hashing) -> Report {
    let hashes = hashing.hash(tokens);
    let json = json!({
        "block_size": hashing.block_size.get(),
        "bigram": hashing.bigram,
        "cache_salt": hashing.cache_salt,
        "token_ids": tokens,
        "hashes": hashes,
    });
    let mut table = format!(
        "{} tokens → {} blocks (block size {}, bigram {}, salt {})\n",
        tokens.len(),
        hashes.len(),
        hashing.block_size,
        hashing.bigram,
        hashing.cache_salt.as_deref().unwrap_or("none"),
    );
    let _ = writeln!(table, "{:>6}  {:>20}  hex", "block", "hash");
    for (i, hash) in hashes.iter().enumerate() {
        let _ = writeln!(table, "{i:>6}  {hash:>20}  {:#018x}", *hash as u64);
    }
    Report::answered(json, table)
}

/// The report of a longest-prefix query: its matches, or why it has none (a failure names the
/// server's reason, such as a replica still recovering, not only its class).
fn prefix_report(answer: Result<PrefixOutcome, QueryError>, query_blocks: usize) -> Report {
    let sent = query_blocks.min(MAX_PREFIX_HASHES);
    let outcome = match answer {
        Ok(outcome) => outcome,
        Err(error) => {
            let label = PrefixOutcome::from_status(&Status::new(error.code, "")).label();
            let mut report = error_report(&error);
            report.json["outcome"] = label.into();
            report.table = format!("{label}: {}", report.table);
            return report;
        }
    };
    match &outcome {
        PrefixOutcome::Matched {
            matches,
            best_prefix_blocks,
            query_blocks,
            blocks_read,
        } => {
            let json = json!({
                "outcome": outcome.label(),
                "query_blocks": query_blocks,
                "sent_blocks": sent,
                "best_prefix_blocks": best_prefix_blocks,
                "blocks_read": blocks_read,
                "matches": matches,
            });
            let mut table = format!(
                "best prefix {best_prefix_blocks} of {query_blocks} blocks{} · blocks read {blocks_read}\n",
                if sent < *query_blocks {
                    format!(" (first {sent} sent)")
                } else {
                    String::new()
                }
            );
            let _ = writeln!(
                table,
                "{:<24}  {:>14}  {:>7}  worker_address",
                "worker_id", "matched_blocks", "share"
            );
            for m in matches {
                let share = 100.0 * f64::from(m.matched_prefix_blocks) / *query_blocks as f64;
                let _ = writeln!(
                    table,
                    "{:<24}  {:>14}  {:>6.1}%  {}",
                    m.worker_id, m.matched_prefix_blocks, share, m.worker_address
                );
            }
            Report::answered(json, table)
        }
        PrefixOutcome::NoMatch => Report::answered(
            json!({
                "outcome": outcome.label(),
                "query_blocks": query_blocks,
                "sent_blocks": sent,
            }),
            format!("no worker holds the first of {query_blocks} blocks\n"),
        ),
        failed => Report {
            json: json!({ "outcome": failed.label() }),
            table: format!("{}\n", failed.label()),
            answered: false,
        },
    }
}

fn error_report(error: &QueryError) -> Report {
    Report {
        json: json!({
            "error": { "code": format!("{:?}", error.code), "message": error.message },
        }),
        table: format!("{error}\n"),
        answered: false,
    }
}

fn match_report(answer: Result<Vec<NodeMatch>, QueryError>) -> Report {
    let matches = match answer {
        Ok(matches) => matches,
        Err(error) => return error_report(&error),
    };
    let mut table = format!(
        "{:<24}  {:<5}  {:>20}  {:>6}  {:>6}  address\n",
        "worker_id", "tier", "hash", "mask", "tokens"
    );
    for node in &matches {
        for tier in &node.tiers {
            for (i, hash) in tier.hashes.iter().enumerate() {
                let mask = tier.component_masks.get(i).copied().unwrap_or(0);
                let tokens = tier.block_sizes.get(i).copied().unwrap_or(0);
                let _ = writeln!(
                    table,
                    "{:<24}  {:<5}  {hash:>20}  {mask:>6}  {tokens:>6}  {}",
                    node.worker_id,
                    tier.tier.to_string(),
                    node.address
                );
            }
        }
    }
    if matches.is_empty() {
        table = "no worker holds any of the blocks\n".into();
    }
    Report::answered(json!({ "matches": matches }), table)
}

fn hits_report(answer: Result<Vec<HitCount>, QueryError>) -> Report {
    let entries = match answer {
        Ok(entries) => entries,
        Err(error) => return error_report(&error),
    };
    let mut table = format!("{:>20}  {:>15}\n", "hash", "hit_count_total");
    for entry in &entries {
        let _ = writeln!(table, "{:>20}  {:>15}", entry.hash, entry.hit_count_total);
    }
    if entries.is_empty() {
        table = "none of the blocks has a hit count\n".into();
    }
    Report::answered(json!({ "entries": entries }), table)
}

fn health_report(answers: &[(&Endpoint, Result<ServingStatus, QueryError>)]) -> Report {
    let mut table = String::new();
    let mut replicas = Vec::new();
    for (endpoint, answer) in answers {
        let (json, text) = match answer {
            Ok(status) => (
                json!({ "endpoint": endpoint.to_string(), "status": status.as_str_name() }),
                status.as_str_name().to_string(),
            ),
            Err(error) => (
                json!({
                    "endpoint": endpoint.to_string(),
                    "error": { "code": format!("{:?}", error.code), "message": error.message },
                }),
                error.to_string(),
            ),
        };
        let _ = writeln!(table, "{endpoint}  {text}");
        replicas.push(json);
    }
    let serving = answers
        .iter()
        .all(|(_, answer)| matches!(answer, Ok(ServingStatus::Serving)));
    Report {
        json: json!({ "serving": serving, "replicas": replicas }),
        table,
        answered: serving,
    }
}

fn state_report(answers: &[(&Endpoint, Result<ServerState, QueryError>)]) -> Report {
    let mut table = String::new();
    let mut replicas = Vec::new();
    for (endpoint, answer) in answers {
        let state = match answer {
            Err(error) => {
                let _ = writeln!(table, "{endpoint}  {error}");
                replicas.push(json!({
                    "endpoint": endpoint.to_string(),
                    "error": { "code": format!("{:?}", error.code), "message": error.message },
                }));
                continue;
            }
            Ok(state) => state,
        };
        let mut line = format!(
            "{endpoint}  ready {} · serving {} · {} workers · {} blocks · {} placements · v{}",
            state.ready,
            state.serving,
            state.workers,
            state.blocks,
            state.placements,
            state.version
        );
        let mut json = json!({
            "endpoint": endpoint.to_string(),
            "ready": state.ready,
            "serving": state.serving,
            "workers": state.workers,
            "blocks": state.blocks,
            "placements": state.placements,
            "version": state.version,
        });
        if let Some(replica) = &state.replica {
            let _ = write!(
                line,
                " · log position {} · lag {} ms, {} entries · fresh {}",
                replica.position, replica.lag_ms, replica.lag_entries, replica.fresh
            );
            json["replica"] = json!({
                "position": replica.position,
                "lag_ms": replica.lag_ms,
                "lag_entries": replica.lag_entries,
                "fresh": replica.fresh,
            });
        }
        if !state.digest.is_empty() {
            let _ = write!(line, " · digest {}", state.digest);
            json["digest"] = state.digest.clone().into();
        }
        if !state.applies_refused.is_empty() {
            let _ = write!(line, " · APPLIES REFUSED: {}", state.applies_refused);
            json["applies_refused"] = state.applies_refused.clone().into();
        }
        let _ = writeln!(table, "{line}");
        replicas.push(json);
    }
    Report {
        json: json!({ "replicas": replicas }),
        table,
        answered: answers.iter().all(|(_, answer)| answer.is_ok()),
    }
}

fn workers_report(answer: Result<Vec<WorkerState>, QueryError>, now_ms: u64) -> Report {
    let workers = match answer {
        Ok(workers) => workers,
        Err(error) => return error_report(&error),
    };
    let mut table = format!(
        "{:<24}  {:>10}  {:>10}  {:>10}  {:>12}  {:<8}  address\n",
        "worker_id", "hbm", "dram", "ssd", "last_apply_s", "state"
    );
    let mut rows = Vec::new();
    for worker in &workers {
        let age_s = (worker.last_apply_ms > 0)
            .then(|| now_ms.saturating_sub(worker.last_apply_ms) as f64 / 1000.0);
        let state = if worker.expired { "expired" } else { "live" };
        let _ = writeln!(
            table,
            "{:<24}  {:>10}  {:>10}  {:>10}  {:>12}  {state:<8}  {}",
            worker.worker_id,
            worker.hbm_placements,
            worker.dram_placements,
            worker.ssd_placements,
            age_s.map_or("-".to_string(), |age| format!("{age:.1}")),
            worker.worker_address,
        );
        rows.push(json!({
            "worker_id": worker.worker_id,
            "worker_address": worker.worker_address,
            "placements": {
                "hbm": worker.hbm_placements,
                "dram": worker.dram_placements,
                "ssd": worker.ssd_placements,
            },
            "last_apply_ms": worker.last_apply_ms,
            "last_apply_age_s": age_s,
            "expired": worker.expired,
            "bridge_incarnation": worker.bridge_incarnation,
            "bridge_batch": worker.bridge_batch,
        }));
    }
    if workers.is_empty() {
        table = "the index knows no worker\n".into();
    }
    Report::answered(json!({ "workers": rows }), table)
}

fn drop_report(worker: &str, answer: Result<u64, QueryError>) -> Report {
    match answer {
        Ok(placements) => Report::answered(
            json!({ "worker_id": worker, "placements_dropped": placements }),
            format!(
                "dropped worker {worker}: {placements} placements (through the log: every replica agrees); its next apply brings it back, so stop its bridge first\n"
            ),
        ),
        Err(error) => error_report(&error),
    }
}

/// Milliseconds since the Unix epoch.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_indexer_client::{Code, PrefixMatch};

    /// Parses `argv` (after the program name); `Ok` gets the hashes a query command would send
    /// (or `hash` would print), `Err` a text the error must contain.
    fn check(argv: &[&str], expect: Result<Vec<i64>, &str>) {
        let mut full = vec!["kv-indexer-ctl"];
        full.extend_from_slice(argv);
        match (Args::try_parse_from(full), expect) {
            (Ok(args), Ok(hashes)) => {
                let got = match &args.command {
                    Command::Hash { tokens, hashing } => hashing.hash(&tokens.token_ids()),
                    Command::Prefix { blocks }
                    | Command::Match { blocks, .. }
                    | Command::Hits { blocks } => blocks.hashes(),
                    Command::Health
                    | Command::State { .. }
                    | Command::Workers
                    | Command::Drop { .. } => Vec::new(),
                };
                assert_eq!(got, hashes, "argv {argv:?}");
            }
            (Err(error), Err(needle)) => {
                let text = error.to_string();
                assert!(text.contains(needle), "{argv:?}: {text:?} lacks {needle:?}");
            }
            (got, want) => panic!("argv {argv:?}: got {got:?}, want {want:?}"),
        }
    }

    fn hashed(tokens: &[u64], block_size: usize, bigram: bool, salt: Option<&str>) -> Vec<i64> {
        block_hashes(tokens, HashConfig { block_size, bigram }, salt)
    }

    #[test]
    fn takes_hashes_tokens_or_text() {
        check(&["prefix", "1", "-2", "3"], Ok(vec![1, -2, 3]));
        check(&["hits", "1,-2,3"], Ok(vec![1, -2, 3]));
        check(
            &["match", "--count-as-hit", "-9223372036854775808"],
            Ok(vec![i64::MIN]),
        );
        check(
            &["prefix", "--tokens", "1", "2", "3", "--block-size", "2"],
            Ok(hashed(&[1, 2, 3], 2, false, None)),
        );
        check(
            &[
                "prefix",
                "--tokens",
                "1,2,3",
                "--bigram",
                "--cache-salt",
                "s",
            ],
            Ok(hashed(&[1, 2, 3], 16, true, Some("s"))),
        );
        let words = simple_tokenize("the quick brown fox");
        check(
            &[
                "prefix",
                "--text",
                "the quick brown fox",
                "--block-size",
                "1",
            ],
            Ok(hashed(&words, 1, false, None)),
        );
        check(
            &["hash", "--text", "the quick brown fox", "--block-size", "2"],
            Ok(hashed(&words, 2, false, None)),
        );
        check(
            &["hash", "5", "6", "7"],
            Ok(hashed(&[5, 6, 7], 16, false, None)),
        );
        check(
            &["--json", "hash", "5,6"],
            Ok(hashed(&[5, 6], 16, false, None)),
        );
    }

    #[test]
    fn rejects_ambiguous_or_missing_input() {
        check(&["prefix"], Err("required"));
        check(&["hash"], Err("required"));
        check(
            &["prefix", "1", "--text", "a b"],
            Err("cannot be used with"),
        );
        check(
            &["prefix", "--tokens", "1", "--text", "a"],
            Err("cannot be used with"),
        );
        check(&["hash", "--block-size", "0", "1"], Err("--block-size"));
        check(&["hash", "-1"], Err("-1"));
        check(&["prefix", "x"], Err("invalid"));
        check(&["--timeout-ms", "0", "hits", "1"], Err("--timeout-ms"));
    }

    #[test]
    fn help_names_the_environment_variables() {
        let mut command = <Args as clap::CommandFactory>::command();
        let help = command.render_long_help().to_string();
        for var in ["KV_INDEXER_ENDPOINT", "KV_INDEXER_CTL_TIMEOUT_MS"] {
            assert!(help.contains(var), "--help does not mention {var}");
        }
        let prefix = command
            .find_subcommand_mut("prefix")
            .unwrap()
            .render_long_help()
            .to_string();
        assert!(prefix.contains("KV_INDEXER_BLOCK_SIZE"), "{prefix}");
    }

    #[test]
    fn reports_truncation_and_shares_against_the_full_prompt() {
        let outcome = PrefixOutcome::Matched {
            matches: vec![PrefixMatch {
                worker_address: "http://a:30000".into(),
                worker_id: "a".into(),
                matched_prefix_blocks: 1_048_574,
            }],
            best_prefix_blocks: 1_048_574,
            query_blocks: 2_097_148,
            blocks_read: 1_048_574,
        };
        let report = prefix_report(Ok(outcome), 2_097_148);
        assert!(report.answered);
        assert_eq!(report.json["sent_blocks"], 1_048_574);
        assert_eq!(report.json["query_blocks"], 2_097_148);
        assert!(
            report.table.contains("(first 1048574 sent)"),
            "{}",
            report.table
        );
        assert!(report.table.contains(" 50.0%"), "{}", report.table);
    }

    #[test]
    fn a_failure_is_not_an_answer_and_names_the_servers_reason() {
        for (code, label) in [
            (Code::Unavailable, "unreachable"),
            (Code::DeadlineExceeded, "timeout"),
            (Code::ResourceExhausted, "overloaded"),
            (Code::OutOfRange, "too_large"),
            (Code::Internal, "rejected"),
        ] {
            let error = QueryError {
                code,
                message: "the state is still being recovered".into(),
            };
            let report = prefix_report(Err(error), 3);
            assert!(!report.answered, "{code:?}");
            assert_eq!(report.json["outcome"], label);
            assert_eq!(
                report.table,
                format!("{label}: {code:?}: the state is still being recovered\n")
            );
        }
        assert!(prefix_report(Ok(PrefixOutcome::NoMatch), 3).answered);
        let report = hits_report(Err(QueryError {
            code: Code::Unavailable,
            message: "down".into(),
        }));
        assert!(!report.answered);
        assert_eq!(report.json["error"]["code"], "Unavailable");
    }
}
