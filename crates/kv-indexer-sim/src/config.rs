//! Flags and environment variables of `kv-indexer-sim` (each flag has its `KV_INDEXER_SIM_…`
//! variable), parsed into a validated [`Config`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use kv_prompt::BlockHasher;
use kv_prompt::hashing::HashConfig;
use kv_prompt::vllm_hashing::{VllmHashAlgo, VllmHasher};

use crate::cache::CacheConfig;
use crate::events::{Encoder, Encoding};
use crate::publisher::{DropPolicy, PublisherConfig};
use crate::timing::TimeModel;

/// A simulated SGLang (or vLLM) worker: the engine's HTTP API over a paged prefix cache,
/// publishing KV events on ZMQ exactly as the engine does.
#[derive(Debug, Clone, Parser)]
#[command(name = "kv-indexer-sim", version)]
pub struct Args {
    /// The engine simulated: sglang (its API, events and hashes) or vllm (vLLM 0.33's OpenAI
    /// API, events and block hashes).
    #[arg(long, env = "KV_INDEXER_SIM_ENGINE", value_enum, default_value_t = EngineArg::Sglang)]
    pub engine: EngineArg,

    /// vLLM's --prefix-caching-hash-algo (sha256 or sha256_cbor), with --engine vllm.
    #[arg(long, env = "KV_INDEXER_SIM_VLLM_HASH_ALGO", default_value = "sha256")]
    pub vllm_hash_algo: VllmHashAlgo,

    /// vLLM's PYTHONHASHSEED (seeds NONE_HASH), with --engine vllm; unset: vLLM's fixed seed.
    #[arg(long, env = "KV_INDEXER_SIM_VLLM_HASH_SEED")]
    pub vllm_hash_seed: Option<String>,

    /// HTTP listen address.
    #[arg(long, env = "KV_INDEXER_SIM_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,

    /// HTTP port (0: any free port).
    #[arg(long, env = "KV_INDEXER_SIM_PORT", default_value_t = 30000)]
    pub port: u16,

    /// The model name reported and accepted.
    #[arg(
        long,
        env = "KV_INDEXER_SIM_MODEL_PATH",
        default_value = "kv-indexer-sim"
    )]
    pub model_path: String,

    /// A Hugging Face tokenizer.json (or a directory holding one); without it, text prompts
    /// are split into words (one token per word).
    #[arg(long, env = "KV_INDEXER_SIM_TOKENIZER_PATH")]
    pub tokenizer_path: Option<PathBuf>,

    /// Tokens per cache page (SGLang's --page-size; the events' block_size).
    #[arg(long, env = "KV_INDEXER_SIM_PAGE_SIZE", default_value_t = 16)]
    pub page_size: usize,

    /// Device cache capacity, in tokens.
    #[arg(long, env = "KV_INDEXER_SIM_CAPACITY_TOKENS", default_value_t = 1 << 20)]
    pub capacity_tokens: usize,

    /// Host (CPU_PINNED) tier capacity, in tokens; 0: no host tier.
    #[arg(long, env = "KV_INDEXER_SIM_HOST_CAPACITY_TOKENS", default_value_t = 0)]
    pub host_capacity_tokens: usize,

    /// Prompt plus output tokens allowed per request.
    #[arg(long, env = "KV_INDEXER_SIM_CONTEXT_LENGTH", default_value_t = 131_072)]
    pub context_length: usize,

    /// Address the KV event PUB socket binds.
    #[arg(
        long,
        env = "KV_INDEXER_SIM_KV_EVENTS_HOST",
        default_value = "127.0.0.1"
    )]
    pub kv_events_host: IpAddr,

    /// Port the KV event PUB socket binds (0: any free port).
    #[arg(long, env = "KV_INDEXER_SIM_KV_EVENTS_PORT", default_value_t = 5557)]
    pub kv_events_port: u16,

    /// Port of the replay ROUTER (on the KV events host); off when unset.
    #[arg(long, env = "KV_INDEXER_SIM_REPLAY_PORT")]
    pub replay_port: Option<u16>,

    /// Batches kept for replay (SGLang's buffer_steps).
    #[arg(
        long,
        env = "KV_INDEXER_SIM_REPLAY_BUFFER_STEPS",
        default_value_t = 10_000
    )]
    pub replay_buffer_steps: usize,

    /// The KV event topic.
    #[arg(long, env = "KV_INDEXER_SIM_TOPIC", default_value = "kv-events")]
    pub topic: String,

    /// Event encoding: map (SGLang 0.5.20 and later) or array (up to 0.5.18).
    #[arg(long, env = "KV_INDEXER_SIM_ENCODING", value_enum, default_value_t = EncodingArg::Map)]
    pub encoding: EncodingArg,

    /// Speculative decoding algorithm; its engines hash token bigrams.
    #[arg(long, env = "KV_INDEXER_SIM_SPECULATIVE_ALGORITHM", value_enum)]
    pub speculative_algorithm: Option<SpeculativeAlgorithm>,

    /// Prefill cost per prompt token not found in the cache, in microseconds (fractions
    /// allowed). Prefills run one after another, as on one GPU.
    #[arg(
        long,
        env = "KV_INDEXER_SIM_PREFILL_US_PER_TOKEN",
        default_value_t = 50.0
    )]
    pub prefill_us_per_token: f64,

    /// Attention's share of the prefill: microseconds per uncached prompt token and per 1,000
    /// tokens before it in the prompt (0: a prefill linear in the uncached tokens).
    #[arg(
        long,
        env = "KV_INDEXER_SIM_PREFILL_US_PER_TOKEN_PER_1K_CONTEXT",
        default_value_t = 0.0
    )]
    pub prefill_us_per_token_per_1k_context: f64,

    /// Decode cost per generated token, in microseconds.
    #[arg(
        long,
        env = "KV_INDEXER_SIM_DECODE_US_PER_TOKEN",
        default_value_t = 5_000
    )]
    pub decode_us_per_token: u64,

    /// Requests running at once; more wait in a queue.
    #[arg(long, env = "KV_INDEXER_SIM_MAX_RUNNING", default_value_t = 64)]
    pub max_running: usize,

    /// A streamed answer sends one chunk per this many output tokens (SGLang's
    /// --stream-interval); the first token and the last always get theirs.
    #[arg(long, env = "KV_INDEXER_SIM_STREAM_INTERVAL", default_value_t = 1)]
    pub stream_interval: usize,

    /// Labels sent as component_types on every BlockStored (full, swa, mamba), as an engine
    /// built with --enable-kv-events-component-types; unset: legacy events.
    #[arg(long, env = "KV_INDEXER_SIM_COMPONENT_TYPES", value_delimiter = ',')]
    pub component_types: Vec<String>,

    /// Lose every n-th live KV event message (still replayable), as a PUB above its
    /// high-water mark; 0: none.
    #[arg(long, env = "KV_INDEXER_SIM_DROP_EVERY", default_value_t = 0)]
    pub drop_every: u64,

    /// Lose them only below this sequence number, so that a test's last messages arrive: a
    /// bridge learns of a lost message only from the next one (unset: throughout).
    #[arg(long, env = "KV_INDEXER_SIM_DROP_UNTIL")]
    pub drop_until: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    Sglang,
    Vllm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EncodingArg {
    Map,
    Array,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpeculativeAlgorithm {
    #[value(name = "EAGLE")]
    Eagle,
    #[value(name = "EAGLE3")]
    Eagle3,
    #[value(name = "FROZEN_KV_MTP")]
    FrozenKvMtp,
}

impl SpeculativeAlgorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            SpeculativeAlgorithm::Eagle => "EAGLE",
            SpeculativeAlgorithm::Eagle3 => "EAGLE3",
            SpeculativeAlgorithm::FrozenKvMtp => "FROZEN_KV_MTP",
        }
    }
}

/// A setting with a value that cannot work, named as the user typed it: the flag and its
/// variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--{flag} ({}) {value}: {reason}", variable(.flag))]
pub struct ConfigError {
    pub flag: &'static str,
    pub value: String,
    pub reason: &'static str,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub http_addr: SocketAddr,
    pub kv_events_addr: SocketAddr,
    pub replay_addr: Option<SocketAddr>,
    pub model_path: String,
    pub tokenizer_path: Option<PathBuf>,
    pub cache: CacheConfig,
    pub context_length: usize,
    pub speculative_algorithm: Option<SpeculativeAlgorithm>,
    pub timing: TimeModel,
    pub max_running: usize,
    pub stream_interval: usize,
    pub publisher: PublisherConfig,
    /// A vLLM worker's hashing (its API, events and hashes); `None` for SGLang.
    pub vllm: Option<VllmHasher>,
}

impl Default for Config {
    /// Loopback on free ports, 16-token pages, no host tier, no replay, zero costs: a worker
    /// for tests.
    fn default() -> Config {
        let loopback = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
        Config {
            http_addr: loopback,
            kv_events_addr: loopback,
            replay_addr: None,
            model_path: "kv-indexer-sim".into(),
            tokenizer_path: None,
            cache: CacheConfig {
                page_size: 16,
                capacity_tokens: 1 << 16,
                host_capacity_tokens: 0,
            },
            context_length: 131_072,
            speculative_algorithm: None,
            timing: TimeModel::default(),
            max_running: 64,
            stream_interval: 1,
            publisher: PublisherConfig::default(),
            vllm: None,
        }
    }
}

impl Config {
    pub fn from_args(args: Args) -> Result<Config, ConfigError> {
        validate(&args)?;
        let micros = |flag, value: f64| {
            Duration::try_from_secs_f64(value / 1e6).map_err(|_| ConfigError {
                flag,
                value: value.to_string(),
                reason: "must be a finite number of microseconds, at least 0",
            })
        };
        let timing = TimeModel {
            prefill_per_token: micros("prefill-us-per-token", args.prefill_us_per_token)?,
            prefill_per_token_per_1k_context: micros(
                "prefill-us-per-token-per-1k-context",
                args.prefill_us_per_token_per_1k_context,
            )?,
            decode_per_token: Duration::from_micros(args.decode_us_per_token),
        };
        let vllm = match args.engine {
            EngineArg::Sglang => None,
            EngineArg::Vllm => Some(
                VllmHasher::new(
                    args.vllm_hash_algo,
                    args.page_size,
                    args.vllm_hash_seed.as_deref(),
                )
                .map_err(|_| ConfigError {
                    flag: "page-size",
                    value: args.page_size.to_string(),
                    reason: "vLLM's block size must be 1 to 4096",
                })?,
            ),
        };
        let encoding = match (args.engine, args.encoding) {
            (EngineArg::Vllm, _) => Encoding::Vllm,
            (EngineArg::Sglang, EncodingArg::Map) => Encoding::Map,
            (EngineArg::Sglang, EncodingArg::Array) => Encoding::Array,
        };
        Ok(Config {
            http_addr: SocketAddr::new(args.host, args.port),
            kv_events_addr: SocketAddr::new(args.kv_events_host, args.kv_events_port),
            replay_addr: args
                .replay_port
                .map(|port| SocketAddr::new(args.kv_events_host, port)),
            model_path: args.model_path,
            tokenizer_path: args.tokenizer_path,
            cache: CacheConfig {
                page_size: args.page_size,
                capacity_tokens: args.capacity_tokens,
                host_capacity_tokens: args.host_capacity_tokens,
            },
            context_length: args.context_length,
            speculative_algorithm: args.speculative_algorithm,
            timing,
            max_running: args.max_running,
            stream_interval: args.stream_interval,
            publisher: PublisherConfig {
                topic: args.topic,
                encoder: Encoder {
                    encoding,
                    component_types: args.component_types,
                },
                attn_dp_rank: Some(0),
                replay_buffer_steps: args.replay_buffer_steps,
                drop: DropPolicy {
                    every: args.drop_every,
                    every_until: args.drop_until,
                    ..DropPolicy::default()
                },
            },
            vllm,
        })
    }

    /// This worker as vLLM, hashing with `hasher`: vLLM's hashes, events and API.
    pub fn vllm(mut self, hasher: VllmHasher) -> Config {
        self.vllm = Some(hasher);
        self.publisher.encoder.encoding = Encoding::Vllm;
        self
    }

    /// How the engine hashes its pages (`block_size` = page size, dcp_size being 1).
    pub fn hash(&self) -> BlockHasher {
        match self.vllm {
            Some(hasher) => BlockHasher::Vllm(hasher),
            None => BlockHasher::Sglang(HashConfig {
                block_size: self.cache.page_size,
                bigram: self.speculative_algorithm.is_some(),
            }),
        }
    }

    /// `sglang` or `vllm`.
    pub fn engine(&self) -> &'static str {
        self.hash().engine()
    }
}

/// The environment variable of `--flag`.
fn variable(flag: &str) -> String {
    format!("KV_INDEXER_SIM_{}", flag.to_uppercase().replace('-', "_"))
}

/// The rules clap cannot check: sizes that hold a page, distinct ports, known labels.
fn validate(args: &Args) -> Result<(), ConfigError> {
    let bad = |flag: &'static str, value: &dyn ToString, reason: &'static str| ConfigError {
        flag,
        value: value.to_string(),
        reason,
    };
    if args.page_size == 0 {
        return Err(bad("page-size", &args.page_size, "must be at least 1"));
    }
    if args.capacity_tokens < args.page_size {
        return Err(bad(
            "capacity-tokens",
            &args.capacity_tokens,
            "must hold at least one page",
        ));
    }
    if args.host_capacity_tokens != 0 && args.host_capacity_tokens < args.page_size {
        return Err(bad(
            "host-capacity-tokens",
            &args.host_capacity_tokens,
            "must be 0 (no host tier) or hold at least one page",
        ));
    }
    if args.max_running == 0 {
        return Err(bad("max-running", &args.max_running, "must be at least 1"));
    }
    if args.stream_interval == 0 {
        return Err(bad(
            "stream-interval",
            &args.stream_interval,
            "must be at least 1",
        ));
    }
    if args.context_length == 0 {
        return Err(bad(
            "context-length",
            &args.context_length,
            "must be at least 1",
        ));
    }
    if let Some(port) = args.replay_port
        && port != 0
        && port == args.kv_events_port
    {
        return Err(bad("replay-port", &port, "is the KV events port"));
    }
    for label in &args.component_types {
        if !matches!(label.as_str(), "full" | "swa" | "mamba") {
            return Err(bad(
                "component-types",
                label,
                "labels are full, swa and mamba",
            ));
        }
    }
    if args.engine == EngineArg::Vllm {
        if let Some(algorithm) = args.speculative_algorithm {
            return Err(bad(
                "speculative-algorithm",
                &algorithm.as_str(),
                "is SGLang's (bigram hashing); vLLM hashes blocks of tokens",
            ));
        }
        if !args.component_types.is_empty() {
            return Err(bad(
                "component-types",
                &args.component_types.join(","),
                "are SGLang's; vLLM's hybrid groups are not simulated",
            ));
        }
        if args.encoding == EncodingArg::Array {
            return Err(bad(
                "encoding",
                &"array",
                "is SGLang's array era; vLLM has one encoding",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, String> {
        let argv = std::iter::once("kv-indexer-sim").chain(args.iter().copied());
        let args = Args::try_parse_from(argv).map_err(|e| e.to_string())?;
        Config::from_args(args).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_bind_loopback_with_sglang_ports() {
        let config = parse(&[]).unwrap();
        assert_eq!(config.http_addr, "127.0.0.1:30000".parse().unwrap());
        assert_eq!(config.kv_events_addr, "127.0.0.1:5557".parse().unwrap());
        assert_eq!(config.replay_addr, None);
        assert_eq!(config.cache.page_size, 16);
        assert_eq!(config.cache.host_capacity_tokens, 0);
        assert_eq!(config.publisher.topic, "kv-events");
        assert_eq!(config.publisher.encoder.encoding, Encoding::Map);
        assert!(config.publisher.encoder.component_types.is_empty());
        assert_eq!(
            config.hash(),
            BlockHasher::Sglang(HashConfig {
                block_size: 16,
                bigram: false
            })
        );
    }

    #[test]
    fn reads_every_setting() {
        let config = parse(&[
            "--port",
            "0",
            "--page-size",
            "4",
            "--capacity-tokens",
            "64",
            "--host-capacity-tokens",
            "32",
            "--kv-events-port",
            "6000",
            "--replay-port",
            "6001",
            "--topic",
            "",
            "--encoding",
            "array",
            "--speculative-algorithm",
            "EAGLE3",
            "--prefill-us-per-token",
            "7",
            "--prefill-us-per-token-per-1k-context",
            "0.25",
            "--stream-interval",
            "8",
            "--decode-us-per-token",
            "9",
            "--max-running",
            "3",
            "--component-types",
            "full,swa",
            "--drop-every",
            "5",
        ])
        .unwrap();
        assert_eq!(config.replay_addr, Some("127.0.0.1:6001".parse().unwrap()));
        assert_eq!(config.cache.capacity_tokens, 64);
        assert_eq!(config.publisher.topic, "");
        assert_eq!(config.publisher.encoder.encoding, Encoding::Array);
        assert_eq!(config.publisher.encoder.component_types, ["full", "swa"]);
        assert_eq!(config.publisher.drop.every, 5);
        assert!(config.hash().bigram());
        assert_eq!(config.timing.prefill_per_token, Duration::from_micros(7));
        assert_eq!(
            config.timing.prefill_per_token_per_1k_context,
            Duration::from_nanos(250)
        );
        assert_eq!(config.stream_interval, 8);
        assert_eq!(config.max_running, 3);
    }

    #[test]
    fn a_bad_value_names_the_variable_as_well_as_the_flag() {
        let error = parse(&["--page-size", "32", "--host-capacity-tokens", "16"]).unwrap_err();
        assert_eq!(
            error,
            "--host-capacity-tokens (KV_INDEXER_SIM_HOST_CAPACITY_TOKENS) 16: \
             must be 0 (no host tier) or hold at least one page"
        );
    }

    #[test]
    fn rejects_bad_values_naming_the_flag() {
        for (args, flag) in [
            (&["--page-size", "0"][..], "--page-size"),
            (
                &["--page-size", "32", "--capacity-tokens", "16"],
                "--capacity-tokens",
            ),
            (&["--host-capacity-tokens", "8"], "--host-capacity-tokens"),
            (&["--max-running", "0"], "--max-running"),
            (&["--stream-interval", "0"], "--stream-interval"),
            (&["--prefill-us-per-token=-1"], "--prefill-us-per-token"),
            (
                &["--prefill-us-per-token-per-1k-context", "NaN"],
                "--prefill-us-per-token-per-1k-context",
            ),
            (&["--replay-port", "5557"], "--replay-port"),
            (&["--component-types", "full,sliding"], "--component-types"),
            (&["--encoding", "json"], "--encoding"),
            (
                &["--speculative-algorithm", "MEDUSA"],
                "--speculative-algorithm",
            ),
        ] {
            let error = parse(args).unwrap_err();
            assert!(error.contains(flag), "{args:?}: {error}");
        }
    }
}
