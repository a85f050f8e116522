//! Router configuration: the flags of the SGLang router's quickstart, each also a variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use kv_indexer_client::BlockHasher;
use kv_indexer_client::ClientSecurity;
use kv_indexer_client::SecurityError;
use kv_indexer_client::endpoint::{Endpoint, EndpointError};
use kv_indexer_client::vllm_hashing::{BadBlockSize, VllmHashAlgo, VllmHasher};

use crate::selection::{Selection, TierWeights};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum PolicyName {
    CacheAware,
    RoundRobin,
    Random,
    PowerOfTwo,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum PrefixProvider {
    Indexer,
    RadixTree,
    /// The workers' own cache views (`POST /cache_prefix`, served by `kv-indexer-sim`): the
    /// perfect-knowledge ceiling for benchmarks.
    Oracle,
}

/// A cache-aware HTTP router for SGLang and vLLM workers, using the KV Indexer as its cache signal.
#[derive(Debug, Clone, Parser)]
#[command(name = "kv-indexer-router", version, about, args_override_self = true)]
pub struct Args {
    /// Address the router listens on.
    #[arg(long, env = "KV_ROUTER_LISTEN_ADDR", default_value = "127.0.0.1:30080")]
    pub listen_addr: SocketAddr,
    /// Worker URLs (as the Indexer knows them: matched byte for byte).
    #[arg(long, env = "KV_ROUTER_WORKER_URLS", num_args = 1.., value_delimiter = ',', required = true)]
    pub worker_urls: Vec<String>,
    #[arg(
        long,
        env = "KV_ROUTER_POLICY",
        value_enum,
        default_value = "cache_aware"
    )]
    pub policy: PolicyName,
    /// Where `cache_aware` gets its prefix signal (default: `indexer` when an endpoint is given).
    #[arg(long, env = "KV_ROUTER_CACHE_PREFIX_PROVIDER", value_enum)]
    pub cache_prefix_provider: Option<PrefixProvider>,
    /// The Indexer: `http(s)://host:port`, a comma-separated list of replicas tried in order.
    #[arg(long, env = "KV_INDEXER_ENDPOINT")]
    pub kv_indexer_endpoint: Option<String>,
    #[arg(long, env = "KV_INDEXER_QUERY_TIMEOUT_MS", default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_indexer_query_timeout_ms: u64,
    #[arg(long, env = "KV_INDEXER_QUERY_MAX_INFLIGHT", default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_indexer_query_max_inflight: u64,
    /// A match shorter than this many tokens is not worth routing for.
    #[arg(
        long,
        env = "KV_ROUTER_CACHE_AFFINITY_MIN_MATCHED_TOKENS",
        default_value_t = 1024
    )]
    pub cache_affinity_min_matched_tokens: usize,
    /// A match covering less than this share of the prompt is not worth routing for.
    #[arg(
        long,
        env = "KV_ROUTER_CACHE_AFFINITY_MIN_MATCH_RATIO",
        default_value_t = 0.0
    )]
    pub cache_affinity_min_match_ratio: f64,
    /// Matches within this many tokens of the longest count as tied; ties go to the lower
    /// load.
    #[arg(
        long,
        env = "KV_ROUTER_CACHE_SWITCH_MARGIN_TOKENS",
        default_value_t = 0
    )]
    pub cache_switch_margin_tokens: usize,
    /// The pressure guard, off unless set: a cache choice gives way to the least loaded
    /// worker when its queued prefill tokens exceed that worker's by more than this many tokens
    /// plus the tokens its cache saves... (Off by default: on both Mooncake traces it cost hits
    /// and bought no time to first token, `bench/routing/decisions.md`.)
    #[arg(long, env = "KV_ROUTER_PRESSURE_ABS_THRESHOLD_TOKENS")]
    pub pressure_abs_threshold_tokens: Option<usize>,
    /// ... and by more than this factor.
    #[arg(long, env = "KV_ROUTER_PRESSURE_REL_THRESHOLD", default_value_t = 1.5)]
    pub pressure_rel_threshold: f64,
    /// The balance guard, off unless set: a cache choice gives way to the least loaded worker
    /// when its active requests exceed the routable workers' mean by more than this many...
    #[arg(long, env = "KV_ROUTER_BALANCE_ABS_THRESHOLD")]
    pub balance_abs_threshold: Option<usize>,
    /// ... and by more than this factor.
    #[arg(long, env = "KV_ROUTER_BALANCE_REL_THRESHOLD", default_value_t = 1.25)]
    pub balance_rel_threshold: f64,
    /// Routing by load picks the least loaded of this many workers drawn at random (0: of
    /// all).
    #[arg(long, env = "KV_ROUTER_MIN_LOAD_CHOICES", default_value_t = 0)]
    pub min_load_choices: usize,
    /// A request with no usable match goes to a worker drawn at random among those whose
    /// prefill pressure is within this many tokens of the lowest (unset: the lowest, ties by
    /// active requests). Gateways that decide on the same load reports then spread their
    /// requests instead of sending them all to the one worker that looks least loaded. The
    /// guards' backup is always the least loaded itself.
    #[arg(long, env = "KV_ROUTER_LOAD_TIE_TOKENS")]
    pub load_tie_tokens: Option<usize>,
    /// What a prefix hit on the host tier (DRAM) is worth against one in HBM (peers use
    /// 0.75-0.8). Only sources that know tiers use it (the Indexer's prefix answer does not).
    #[arg(long, env = "KV_ROUTER_CACHE_HIT_WEIGHT_DRAM", default_value_t = 0.75)]
    pub cache_hit_weight_dram: f64,
    /// What a block the Indexer only predicts is worth against a confirmed one on the device:
    /// at least 0 and below 1, so a prediction never outranks a confirmed placement of the
    /// same prefix.
    #[arg(
        long,
        env = "KV_ROUTER_CACHE_HIT_WEIGHT_PREDICTED",
        default_value_t = 0.5
    )]
    pub cache_hit_weight_predicted: f64,
    /// How long the Indexer keeps this router's prediction that a worker will hold a prompt it
    /// was sent, so that every router sends siblings of a new prefix after it before the
    /// worker's events arrive (ours, PredictExternalKv). 0: neither sent nor asked for.
    #[arg(long, env = "KV_INDEXER_PREDICTION_TTL_MS", default_value_t = 2000)]
    pub kv_indexer_prediction_ttl_ms: u64,
    /// With an exact source and no usable match, route where the local radix tree sent the
    /// prompt's prefix before (conversation affinity) before routing by load. Off by default:
    /// on both Mooncake traces it gained no hits and cost time to first token
    /// (`bench/routing/decisions.md`).
    /// Takes 1/0, true/false, yes/no, on/off.
    #[arg(
        long,
        env = "KV_ROUTER_CONVERSATION_AFFINITY",
        default_value_t = false,
        action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub conversation_affinity: bool,
    /// A `tokenizer.json`, or a directory holding one, encoding with special tokens as SGLang
    /// does; one that cannot load stops start-up. Without it text uses the built-in
    /// deterministic tokenizer (the simulated worker's).
    #[arg(long, env = "KV_ROUTER_TOKENIZER_PATH")]
    pub tokenizer_path: Option<PathBuf>,
    #[arg(long, env = "KV_ROUTER_MODEL_ID", default_value = "default")]
    pub model_id: String,
    /// Tokens the local radix tree remembers.
    #[arg(long, env = "KV_ROUTER_RADIX_MAX_TOKENS", default_value_t = 4_000_000)]
    pub radix_max_tokens: usize,
    /// Seconds between worker health checks.
    #[arg(long, env = "KV_ROUTER_HEALTH_INTERVAL_SECS", default_value_t = 2)]
    pub health_interval_secs: u64,
    /// The workers' engine: sglang (block hashing learned from the first worker's
    /// `/server_info`) or vllm (learned from the first worker's `/metrics`
    /// `vllm:cache_config_info`, or given by the --vllm-* flags). Workers of two engines need a
    /// router each; both can share one Indexer.
    #[arg(long, env = "KV_ROUTER_ENGINE", value_enum, default_value_t = Engine::Sglang)]
    pub engine: Engine,
    /// vLLM's --block-size on the workers (with --engine vllm; unset: learned).
    #[arg(long, env = "KV_ROUTER_VLLM_BLOCK_SIZE")]
    pub vllm_block_size: Option<usize>,
    /// vLLM's --prefix-caching-hash-algo on the workers: sha256 or sha256_cbor (unset: learned;
    /// xxhash's seed is random per process unless PYTHONHASHSEED is set, so no router can
    /// follow it).
    #[arg(long, env = "KV_ROUTER_VLLM_HASH_ALGO")]
    pub vllm_hash_algo: Option<VllmHashAlgo>,
    /// The workers' PYTHONHASHSEED, which seeds vLLM's NONE_HASH (unset: vLLM's fixed seed;
    /// vLLM does not publish it).
    #[arg(long, env = "KV_ROUTER_VLLM_HASH_SEED")]
    pub vllm_hash_seed: Option<String>,
    /// Milliseconds between polls of every worker's load (SGLang's `GET /get_load`, vLLM's
    /// running and waiting gauges on `GET /metrics`), so that routing by load sees what other
    /// routers sent too (0: count only what this router sent).
    #[arg(long, env = "KV_ROUTER_WORKER_LOAD_INTERVAL_MS", default_value_t = 100)]
    pub worker_load_interval_ms: u64,
    /// TLS and the read token for the Indexer.
    #[command(flatten)]
    pub indexer_security: ClientSecurity,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Engine {
    Sglang,
    Vllm,
}

/// How the router comes to know the workers' block hashing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashingSource {
    /// SGLang: the first worker's `/server_info`.
    SglangServerInfo,
    /// vLLM: the first worker's `/metrics` (`vllm:cache_config_info`'s `block_size` and
    /// `prefix_caching_hash_algo` labels), each flag given standing in for its label.
    VllmMetrics {
        block_size: Option<usize>,
        algo: Option<VllmHashAlgo>,
        seed: Option<String>,
    },
}

impl HashingSource {
    /// The hashing when the flags give all of it.
    pub fn fixed(&self) -> Option<BlockHasher> {
        match self {
            HashingSource::VllmMetrics {
                block_size: Some(block_size),
                algo: Some(algo),
                seed,
            } => VllmHasher::new(*algo, *block_size, seed.as_deref())
                .ok()
                .map(BlockHasher::Vllm),
            _ => None,
        }
    }
}

/// The validated settings.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub worker_urls: Vec<String>,
    pub policy: PolicyName,
    pub provider: PrefixProvider,
    pub indexer: Option<Vec<Endpoint>>,
    pub query_timeout: Duration,
    pub query_max_inflight: usize,
    /// `None`: predictions are neither sent nor asked for.
    pub prediction_ttl: Option<Duration>,
    pub selection: Selection,
    pub min_load_choices: usize,
    pub load_tie_tokens: Option<usize>,
    pub conversation_affinity: bool,
    pub tokenizer_path: Option<PathBuf>,
    pub model_id: String,
    pub radix_max_tokens: usize,
    pub health_interval: Duration,
    /// `None`: the workers' load reports are not polled.
    pub worker_load_interval: Option<Duration>,
    pub engine: Engine,
    /// Where the workers' block hashing comes from.
    pub hashing: HashingSource,
    pub indexer_security: ClientSecurity,
}

/// How errors name the tokenizer setting: the flag and the variable the router reads.
pub const TOKENIZER_SETTING: &str = "--tokenizer-path (KV_ROUTER_TOKENIZER_PATH)";

/// A setting that can never work, named as the flag and the variable the router reads.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--kv-indexer-endpoint (KV_INDEXER_ENDPOINT)")]
    Endpoint(#[source] EndpointError),
    #[error(
        "--cache-prefix-provider indexer (KV_ROUTER_CACHE_PREFIX_PROVIDER) needs \
         --kv-indexer-endpoint (KV_INDEXER_ENDPOINT)"
    )]
    IndexerWithoutEndpoint,
    #[error("{}", security_setting(.0))]
    Security(#[source] SecurityError),
    #[error("--worker-urls (KV_ROUTER_WORKER_URLS): {url:?} is not an http(s)://host:port URL")]
    WorkerUrl { url: String },
    #[error("--vllm-block-size (KV_ROUTER_VLLM_BLOCK_SIZE)")]
    VllmBlockSize(#[source] BadBlockSize),
    #[error("--{flag} ({variable}) {value}: {reason}")]
    OutOfRange {
        flag: &'static str,
        variable: &'static str,
        value: f64,
        reason: &'static str,
    },
}

impl RouterConfig {
    /// Checks what clap cannot, naming the flag at fault: a bad Indexer endpoint stops start-up.
    pub fn from_args(args: &Args) -> Result<RouterConfig, ConfigError> {
        let indexer = args
            .kv_indexer_endpoint
            .as_deref()
            .map(Endpoint::parse_list)
            .transpose()
            .map_err(ConfigError::Endpoint)?;
        let provider = match (args.cache_prefix_provider, &indexer) {
            (Some(PrefixProvider::Indexer), None) => {
                return Err(ConfigError::IndexerWithoutEndpoint);
            }
            (Some(provider), _) => provider,
            (None, Some(_)) => PrefixProvider::Indexer,
            (None, None) => PrefixProvider::RadixTree,
        };
        args.indexer_security
            .load()
            .map_err(ConfigError::Security)?;
        for url in &args.worker_urls {
            let parsed: Result<http::Uri, _> = url.parse();
            if !matches!(parsed, Ok(ref uri) if uri.scheme().is_some() && uri.host().is_some()) {
                return Err(ConfigError::WorkerUrl { url: url.clone() });
            }
        }
        let selection = selection(args)?;
        let hashing = match args.engine {
            Engine::Sglang => HashingSource::SglangServerInfo,
            Engine::Vllm => {
                if let Some(block_size) = args.vllm_block_size {
                    VllmHasher::new(VllmHashAlgo::Sha256, block_size, None)
                        .map_err(ConfigError::VllmBlockSize)?;
                }
                HashingSource::VllmMetrics {
                    block_size: args.vllm_block_size,
                    algo: args.vllm_hash_algo,
                    seed: args.vllm_hash_seed.clone(),
                }
            }
        };
        Ok(RouterConfig {
            worker_urls: args.worker_urls.clone(),
            policy: args.policy,
            provider,
            indexer,
            query_timeout: Duration::from_millis(args.kv_indexer_query_timeout_ms),
            query_max_inflight: args.kv_indexer_query_max_inflight as usize,
            prediction_ttl: (args.kv_indexer_prediction_ttl_ms > 0)
                .then(|| Duration::from_millis(args.kv_indexer_prediction_ttl_ms)),
            selection,
            min_load_choices: args.min_load_choices,
            load_tie_tokens: args.load_tie_tokens,
            conversation_affinity: args.conversation_affinity,
            tokenizer_path: args.tokenizer_path.clone(),
            model_id: args.model_id.clone(),
            radix_max_tokens: args.radix_max_tokens,
            health_interval: Duration::from_secs(args.health_interval_secs.max(1)),
            worker_load_interval: (args.worker_load_interval_ms > 0)
                .then(|| Duration::from_millis(args.worker_load_interval_ms)),
            indexer_security: args.indexer_security.clone(),
            engine: args.engine,
            hashing,
        })
    }
}

/// The cache-aware policy's settings, each fraction and factor checked against its range.
fn selection(args: &Args) -> Result<Selection, ConfigError> {
    let share = |flag, variable, value: f64| {
        in_range(
            flag,
            variable,
            value,
            (0.0..=1.0).contains(&value),
            "must be between 0 and 1",
        )
    };
    let rel = args.pressure_rel_threshold;
    let balance = args.balance_rel_threshold;
    Ok(Selection {
        min_matched_tokens: args.cache_affinity_min_matched_tokens,
        min_match_ratio: share(
            "cache-affinity-min-match-ratio",
            "KV_ROUTER_CACHE_AFFINITY_MIN_MATCH_RATIO",
            args.cache_affinity_min_match_ratio,
        )?,
        switch_margin_tokens: args.cache_switch_margin_tokens,
        pressure_abs_threshold_tokens: args.pressure_abs_threshold_tokens,
        pressure_rel_threshold: in_range(
            "pressure-rel-threshold",
            "KV_ROUTER_PRESSURE_REL_THRESHOLD",
            rel,
            rel.is_finite() && rel >= 1.0,
            "must be a finite number, at least 1",
        )?,
        balance_abs_threshold: args.balance_abs_threshold,
        balance_rel_threshold: in_range(
            "balance-rel-threshold",
            "KV_ROUTER_BALANCE_REL_THRESHOLD",
            balance,
            balance.is_finite() && balance >= 1.0,
            "must be a finite number, at least 1",
        )?,
        weights: TierWeights {
            dram: share(
                "cache-hit-weight-dram",
                "KV_ROUTER_CACHE_HIT_WEIGHT_DRAM",
                args.cache_hit_weight_dram,
            )?,
            predicted: in_range(
                "cache-hit-weight-predicted",
                "KV_ROUTER_CACHE_HIT_WEIGHT_PREDICTED",
                args.cache_hit_weight_predicted,
                (0.0..1.0).contains(&args.cache_hit_weight_predicted),
                "must be at least 0 and below 1",
            )?,
        },
    })
}

/// The settings a client security error is about, as the flags and variables the router reads
/// (a bad file names its variable in the error itself).
fn security_setting(error: &SecurityError) -> &'static str {
    match error {
        SecurityError::BadToken => "--indexer-token (KV_INDEXER_TOKEN)",
        SecurityError::HalfIdentity => {
            "--indexer-client-cert (KV_INDEXER_CLIENT_CERT) and --indexer-client-key (KV_INDEXER_CLIENT_KEY)"
        }
        _ => "the Indexer TLS settings",
    }
}

/// `value` when `ok`, else the error naming the flag, its variable and `reason`.
fn in_range(
    flag: &'static str,
    variable: &'static str,
    value: f64,
    ok: bool,
    reason: &'static str,
) -> Result<f64, ConfigError> {
    if ok {
        Ok(value)
    } else {
        Err(ConfigError::OutOfRange {
            flag,
            variable,
            value,
            reason,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The config, or the error with its chain of causes as the binary prints it.
    fn config(argv: &[&str]) -> Result<RouterConfig, String> {
        let mut full = vec!["kv-indexer-router"];
        full.extend_from_slice(argv);
        let args = Args::try_parse_from(full).map_err(|e| e.to_string())?;
        RouterConfig::from_args(&args).map_err(|error| kv_common::error_chain(&error))
    }

    #[test]
    fn the_vllm_engine_learns_its_hashing_unless_the_flags_give_it() {
        let workers = ["--worker-urls", "http://a:1"];
        let config = |extra: &[&str]| config(&[&workers[..], extra].concat());
        let sglang = config(&[]).unwrap();
        assert_eq!(sglang.hashing, HashingSource::SglangServerInfo);
        assert_eq!(
            sglang.hashing.fixed(),
            None,
            "SGLang's is learned from the workers"
        );
        let vllm = config(&["--engine", "vllm", "--vllm-block-size", "32"]).unwrap();
        assert_eq!(
            vllm.hashing.fixed(),
            None,
            "the algorithm is learned from /metrics"
        );
        let vllm = config(&[
            "--engine",
            "vllm",
            "--vllm-block-size",
            "32",
            "--vllm-hash-algo",
            "sha256",
            "--vllm-hash-seed",
            "0",
        ])
        .unwrap();
        let expected = VllmHasher::new(VllmHashAlgo::Sha256, 32, Some("0")).unwrap();
        assert_eq!(vllm.hashing.fixed(), Some(BlockHasher::Vllm(expected)));
        let error = config(&["--engine", "vllm", "--vllm-block-size", "0"]).unwrap_err();
        assert!(
            error.contains("--vllm-block-size (KV_ROUTER_VLLM_BLOCK_SIZE)"),
            "{error}"
        );
        let error = config(&["--engine", "vllm", "--vllm-hash-algo", "xxhash"]).unwrap_err();
        assert!(
            error.contains("not a reproducible vLLM hash algorithm"),
            "{error}"
        );
    }

    #[test]
    fn indexer_is_the_provider_when_an_endpoint_is_given() {
        let c = config(&[
            "--worker-urls",
            "http://a:1,http://b:2",
            "--kv-indexer-endpoint",
            "http://[::1]:50051",
        ])
        .unwrap();
        assert_eq!(c.provider, PrefixProvider::Indexer);
        assert_eq!(c.worker_urls, ["http://a:1", "http://b:2"]);
        assert_eq!(c.query_timeout, Duration::from_millis(100));
        assert_eq!(c.query_max_inflight, 32);
        assert_eq!(c.prediction_ttl, Some(Duration::from_secs(2)));
        assert_eq!(c.selection.min_matched_tokens, 1024);
        assert!(!c.conversation_affinity);
    }

    #[test]
    fn takes_the_indexer_tls_and_token_settings() {
        let c = config(&[
            "--worker-urls",
            "http://a:1",
            "--kv-indexer-endpoint",
            "https://indexer:50051",
            "--indexer-tls-domain",
            "indexer.internal",
            "--indexer-token",
            "r-secret",
        ])
        .unwrap();
        assert_eq!(
            c.indexer_security.tls_domain.as_deref(),
            Some("indexer.internal")
        );
        assert_eq!(
            c.indexer_security
                .token
                .as_ref()
                .map(kv_common::Secret::expose),
            Some("r-secret")
        );
        let error = config(&[
            "--worker-urls",
            "http://a:1",
            "--indexer-ca",
            "/nonexistent/ca.pem",
        ])
        .unwrap_err();
        assert!(error.contains("KV_INDEXER_TLS_CA"), "{error}");
        let error = config(&[
            "--worker-urls",
            "http://a:1",
            "--indexer-client-cert",
            "c.pem",
        ])
        .unwrap_err();
        assert!(error.contains("--indexer-client-key"), "{error}");
    }

    #[test]
    fn reads_the_selection_settings() {
        let c = config(&[
            "--worker-urls",
            "http://a:1",
            "--cache-prefix-provider",
            "oracle",
            "--cache-affinity-min-match-ratio",
            "0.25",
            "--cache-switch-margin-tokens",
            "512",
            "--pressure-abs-threshold-tokens",
            "4096",
            "--pressure-rel-threshold",
            "2",
            "--min-load-choices",
            "2",
            "--load-tie-tokens",
            "2048",
            "--cache-hit-weight-dram",
            "0.8",
            "--conversation-affinity",
            "true",
            "--balance-abs-threshold",
            "4",
            "--cache-hit-weight-predicted",
            "0.25",
        ])
        .unwrap();
        assert_eq!(c.provider, PrefixProvider::Oracle);
        assert_eq!(
            c.selection,
            Selection {
                min_matched_tokens: 1024,
                min_match_ratio: 0.25,
                switch_margin_tokens: 512,
                pressure_abs_threshold_tokens: Some(4096),
                pressure_rel_threshold: 2.0,
                balance_abs_threshold: Some(4),
                balance_rel_threshold: 1.25,
                weights: TierWeights {
                    dram: 0.8,
                    predicted: 0.25,
                },
            }
        );
        assert_eq!(c.min_load_choices, 2);
        assert_eq!(c.load_tie_tokens, Some(2048));
        assert!(c.conversation_affinity);
    }

    #[test]
    fn a_boolean_takes_1_0_true_false_yes_no_on_off() {
        for (value, expected) in [
            ("1", true),
            ("0", false),
            ("true", true),
            ("false", false),
            ("yes", true),
            ("no", false),
            ("on", true),
            ("off", false),
            ("TRUE", true),
            ("Off", false),
        ] {
            let c = config(&[
                "--worker-urls",
                "http://a:1",
                "--conversation-affinity",
                value,
            ])
            .unwrap_or_else(|error| panic!("{value:?} refused: {error}"));
            assert_eq!(c.conversation_affinity, expected, "{value:?}");
        }
    }

    #[test]
    fn radix_tree_without_an_endpoint() {
        let c = config(&["--worker-urls", "http://a:1"]).unwrap();
        assert_eq!(c.provider, PrefixProvider::RadixTree);
        assert_eq!(c.policy, PolicyName::CacheAware);
    }

    #[test]
    fn errors_name_the_variable_the_router_reads() {
        for (argv, variable) in [
            (
                &[
                    "--worker-urls",
                    "http://a:1",
                    "--kv-indexer-endpoint",
                    "a:1",
                ][..],
                "KV_INDEXER_ENDPOINT",
            ),
            (
                &[
                    "--worker-urls",
                    "http://a:1",
                    "--cache-prefix-provider",
                    "indexer",
                ][..],
                "KV_ROUTER_CACHE_PREFIX_PROVIDER",
            ),
            (&["--worker-urls", "a:1"][..], "KV_ROUTER_WORKER_URLS"),
            (
                &["--worker-urls", "http://a:1", "--indexer-token", "a b"][..],
                "--indexer-token (KV_INDEXER_TOKEN): the Indexer token must be visible ASCII",
            ),
        ] {
            let error = config(argv).expect_err("must be rejected");
            assert!(
                error.contains(variable),
                "{error:?} does not name {variable}"
            );
        }
    }

    #[test]
    fn rejects_what_can_never_work_naming_the_flag() {
        for (argv, needle) in [
            (
                &[
                    "--worker-urls",
                    "http://a:1",
                    "--kv-indexer-endpoint",
                    "localhost:50051",
                ][..],
                "--kv-indexer-endpoint",
            ),
            (
                &[
                    "--worker-urls",
                    "http://a:1",
                    "--cache-prefix-provider",
                    "indexer",
                ][..],
                "--cache-prefix-provider",
            ),
            (&["--worker-urls", "a:1"][..], "--worker-urls"),
            (
                &["--worker-urls", "http://a:1", "--policy", "fastest"][..],
                "--policy",
            ),
            (
                &[
                    "--worker-urls",
                    "http://a:1",
                    "--cache-affinity-min-match-ratio",
                    "1.5",
                ][..],
                "--cache-affinity-min-match-ratio (KV_ROUTER_CACHE_AFFINITY_MIN_MATCH_RATIO) 1.5",
            ),
            (
                &[
                    "--worker-urls",
                    "http://a:1",
                    "--pressure-rel-threshold",
                    "0.5",
                ][..],
                "--pressure-rel-threshold",
            ),
            (
                &[
                    "--worker-urls",
                    "http://a:1",
                    "--cache-hit-weight-dram",
                    "NaN",
                ][..],
                "--cache-hit-weight-dram",
            ),
            (
                &[
                    "--worker-urls",
                    "http://a:1",
                    "--balance-rel-threshold",
                    "0.9",
                ][..],
                "--balance-rel-threshold",
            ),
            (
                &[
                    "--worker-urls",
                    "http://a:1",
                    "--cache-hit-weight-predicted",
                    "1",
                ][..],
                "--cache-hit-weight-predicted (KV_ROUTER_CACHE_HIT_WEIGHT_PREDICTED) 1: must be at least 0 and below 1",
            ),
            (
                &[
                    "--worker-urls",
                    "http://a:1",
                    "--conversation-affinity",
                    "maybe",
                ][..],
                "--conversation-affinity",
            ),
            (
                &[
                    "--worker-urls",
                    "http://a:1",
                    "--kv-indexer-query-timeout-ms",
                    "0",
                ][..],
                "--kv-indexer-query-timeout-ms",
            ),
        ] {
            let error = config(argv).expect_err("must be rejected");
            assert!(error.contains(needle), "{error:?} does not name {needle}");
        }
    }
}
