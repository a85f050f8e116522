//! Bridge configuration: every variable of the contract's "Bridge contract", each also a flag.

use std::time::Duration;

use clap::Parser;
use kv_events::Engine;
use kv_index::{COMPONENT_FULL, COMPONENT_MAMBA, COMPONENT_SWA, CacheSpec, Tier};
use kv_indexer_client::security::{PemError, SecurityError};
use kv_indexer_client::{ClientSecurity, Credentials};

/// Follows one SGLang or vLLM worker's KV event stream and applies it to the Indexer.
#[derive(Debug, Clone, Parser)]
#[command(name = "kv-indexer-bridge", version, about)]
pub struct Args {
    /// The worker's stable identity in the index (required).
    #[arg(long, env = "KV_INDEXER_WORKER_ID")]
    pub worker_id: String,
    /// The router-facing worker URL sent with every batch.
    #[arg(long, env = "KV_INDEXER_WORKER_ADDRESS", default_value = "")]
    pub worker_address: String,
    /// The Indexer's gRPC endpoint; a comma-separated list is a fleet of replicas, tried in
    /// order: a failed apply is retried on the next.
    #[arg(
        long,
        env = "KV_INDEXER_ENDPOINT",
        default_value = "http://[::1]:50051"
    )]
    pub endpoint: String,
    /// The engine that publishes the events: sglang or vllm (same frames and replay; vLLM's own
    /// payload, media and hashes).
    #[arg(long, env = "KV_INDEXER_ENGINE", default_value = "sglang")]
    pub engine: Engine,
    /// The worker's ZMQ PUB endpoint (vLLM's `--kv-events-config` endpoint too).
    #[arg(
        long,
        env = "SGLANG_KV_EVENT_ENDPOINT",
        default_value = "tcp://127.0.0.1:5557"
    )]
    pub event_endpoint: String,
    /// The topic the publisher sends on ("" = every message).
    #[arg(long, env = "SGLANG_KV_EVENT_TOPIC", default_value = "")]
    pub event_topic: String,
    /// The publisher's replay ROUTER endpoint (replay off when unset).
    #[arg(long, env = "SGLANG_KV_REPLAY_ENDPOINT")]
    pub replay_endpoint: Option<String>,
    /// Tiers cleared on AllBlocksCleared and when events were lost.
    #[arg(long, env = "KV_INDEXER_CLEAR_TIERS", default_value = "HBM,DRAM,SSD")]
    pub clear_tiers: TierList,
    /// Cache components beyond FULL (`full,swa` or `full,mamba`); unset = legacy worker.
    #[arg(long, env = "KV_INDEXER_CACHE_COMPONENTS")]
    pub cache_components: Option<Components>,
    /// SWA window in tokens (required with swa).
    #[arg(long, env = "KV_INDEXER_SWA_WINDOW_TOKENS")]
    pub swa_window_tokens: Option<u32>,
    /// Tiers FULL may be served from.
    #[arg(long, env = "KV_INDEXER_FULL_TIERS", default_value = "HBM,DRAM")]
    pub full_tiers: TierList,
    /// Tiers SWA may be served from.
    #[arg(long, env = "KV_INDEXER_SWA_TIERS", default_value = "HBM,DRAM")]
    pub swa_tiers: TierList,
    /// Tiers MAMBA may be served from.
    #[arg(long, env = "KV_INDEXER_MAMBA_TIERS", default_value = "HBM,DRAM")]
    pub mamba_tiers: TierList,
    /// The cache spec version sent.
    #[arg(long, env = "KV_INDEXER_CACHE_SPEC_VERSION", default_value_t = 1)]
    pub cache_spec_version: u32,
    /// Batches held while the Indexer is unreachable; on overflow the queue is dropped and the
    /// worker cleared once connected.
    #[arg(long, env = "KV_INDEXER_BRIDGE_QUEUE_BATCHES", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub queue_batches: u32,
    /// An empty-actions apply at this interval keeps the worker's address and spec current (0 = off).
    #[arg(long, env = "KV_INDEXER_HEARTBEAT_MS", default_value_t = 5_000)]
    pub heartbeat_ms: u64,
    /// Admin HTTP address serving Prometheus metrics on /metrics (off when unset).
    #[arg(long, env = "KV_INDEXER_BRIDGE_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// TLS and the write token (`KV_INDEXER_TOKEN`) for the Indexer.
    #[command(flatten)]
    pub security: ClientSecurity,
}

/// A list of tiers from `HBM|GPU`, `DRAM|CPU|CPU_PINNED`, `SSD|DISK`, comma-separated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierList(pub Vec<Tier>);

impl TierList {
    /// The tier bitmask of a `WorkerCacheSpec` (`1 << TierType` per tier).
    pub fn mask(&self) -> u32 {
        self.0.iter().fold(0, |mask, tier| mask | tier.mask_bit())
    }
}

impl std::str::FromStr for TierList {
    type Err = ValueError;

    fn from_str(value: &str) -> Result<TierList, ValueError> {
        let mut tiers = Vec::new();
        for name in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let tier = match name.to_ascii_uppercase().as_str() {
                "HBM" | "GPU" => Tier::Hbm,
                "DRAM" | "CPU" | "CPU_PINNED" => Tier::Dram,
                "SSD" | "DISK" => Tier::Ssd,
                _ => return Err(ValueError::UnknownTier(name.to_string())),
            };
            if !tiers.contains(&tier) {
                tiers.push(tier);
            }
        }
        Ok(TierList(tiers))
    }
}

/// Cache components beyond FULL, as a component mask (FULL always included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Components(pub u32);

impl std::str::FromStr for Components {
    type Err = ValueError;

    fn from_str(value: &str) -> Result<Components, ValueError> {
        let mut components = COMPONENT_FULL;
        for name in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            components |= match name.to_ascii_lowercase().as_str() {
                "full" => COMPONENT_FULL,
                "swa" => COMPONENT_SWA,
                "mamba" => COMPONENT_MAMBA,
                _ => return Err(ValueError::UnknownComponent(name.to_string())),
            };
        }
        if components & COMPONENT_SWA != 0 && components & COMPONENT_MAMBA != 0 {
            return Err(ValueError::SwaWithMamba);
        }
        Ok(Components(components))
    }
}

/// A value that is not a tier list or a component list (clap adds the flag and the value).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error("unknown tier {0:?} (use HBM|GPU, DRAM|CPU|CPU_PINNED, SSD|DISK)")]
    UnknownTier(String),
    #[error("unknown component {0:?} (use full, swa, mamba)")]
    UnknownComponent(String),
    #[error("swa and mamba together are not a supported cache (use full,swa or full,mamba)")]
    SwaWithMamba,
}

/// A setting that cannot work, naming the variable (and flag) the binary reads it from.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("KV_INDEXER_WORKER_ID (--worker-id) must not be empty")]
    EmptyWorkerId,
    #[error("KV_INDEXER_ENDPOINT (--endpoint) {0:?} must be an http:// or https:// URL")]
    EndpointScheme(String),
    /// A TLS file that cannot be read or holds no PEM (the error names its variable).
    #[error(transparent)]
    TlsFile(PemError),
    /// Any other TLS or token setting the Indexer client cannot use.
    #[error("{setting}")]
    Security {
        setting: &'static str,
        #[source]
        source: SecurityError,
    },
    #[error("{setting} {endpoint:?} must be a tcp://host:port endpoint to connect to")]
    ZmqEndpoint {
        setting: &'static str,
        endpoint: String,
    },
    #[error("KV_INDEXER_SWA_WINDOW_TOKENS (--swa-window-tokens) must be set above 0 with swa")]
    SwaWindow,
    #[error("KV_INDEXER_CACHE_SPEC_VERSION (--cache-spec-version) {0} is not supported (0 or 1)")]
    SpecVersion(u32),
    #[error(
        "KV_INDEXER_CACHE_COMPONENTS (--cache-components) is for SGLang: a vLLM worker is indexed whole-block (its hybrid models, with more than one KV-cache group, are not indexed)"
    )]
    VllmComponents,
}

const ENDPOINT: &str = "KV_INDEXER_ENDPOINT (--endpoint)";
const EVENT_ENDPOINT: &str = "SGLANG_KV_EVENT_ENDPOINT (--event-endpoint)";
const REPLAY_ENDPOINT: &str = "SGLANG_KV_REPLAY_ENDPOINT (--replay-endpoint)";

impl From<SecurityError> for ConfigError {
    fn from(error: SecurityError) -> ConfigError {
        let setting = match error {
            SecurityError::Pem(pem) => return ConfigError::TlsFile(pem),
            SecurityError::BadToken => "KV_INDEXER_TOKEN (--indexer-token)",
            SecurityError::HalfIdentity => {
                "KV_INDEXER_CLIENT_CERT (--indexer-client-cert) and KV_INDEXER_CLIENT_KEY (--indexer-client-key)"
            }
            SecurityError::TlsOnPlainEndpoint { .. }
            | SecurityError::Tls { .. }
            | SecurityError::Address { .. } => ENDPOINT,
        };
        ConfigError::Security {
            setting,
            source: error,
        }
    }
}

/// The validated settings the bridge runs with.
#[derive(Debug, Clone)]
pub struct BridgeConfig {
    pub worker_id: String,
    pub worker_address: String,
    /// The Indexer replicas, in the order they are tried (at least one).
    pub endpoints: Vec<String>,
    pub engine: Engine,
    pub event_endpoint: String,
    pub event_topic: String,
    pub replay_endpoint: Option<String>,
    pub clear_tiers: Vec<Tier>,
    /// `None` = legacy worker (which also clears any spec stored before).
    pub cache_spec: Option<CacheSpec>,
    pub queue_batches: usize,
    pub heartbeat: Option<Duration>,
    /// How long to wait for each replay reply before giving up on the replay.
    pub replay_timeout: Duration,
    /// TLS and token, read and checked.
    pub credentials: Credentials,
}

impl BridgeConfig {
    /// Checks the settings that clap cannot check alone, naming the variable at fault.
    pub fn from_args(args: Args) -> Result<BridgeConfig, ConfigError> {
        if args.worker_id.trim().is_empty() {
            return Err(ConfigError::EmptyWorkerId);
        }
        let endpoints: Vec<String> = args
            .endpoint
            .split(',')
            .map(|e| e.trim().to_owned())
            .collect();
        for endpoint in &endpoints {
            if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                return Err(ConfigError::EndpointScheme(endpoint.clone()));
            }
        }
        let credentials = args.security.load()?;
        for endpoint in &endpoints {
            credentials.endpoint(endpoint)?;
        }
        check_zmq_endpoint(EVENT_ENDPOINT, &args.event_endpoint)?;
        if let Some(replay) = &args.replay_endpoint {
            check_zmq_endpoint(REPLAY_ENDPOINT, replay)?;
        }
        let cache_spec = cache_spec(&args)?;
        Ok(BridgeConfig {
            worker_id: args.worker_id,
            worker_address: args.worker_address,
            endpoints,
            engine: args.engine,
            event_endpoint: args.event_endpoint,
            event_topic: args.event_topic,
            replay_endpoint: args.replay_endpoint,
            clear_tiers: args.clear_tiers.0,
            cache_spec,
            queue_batches: args.queue_batches as usize,
            heartbeat: (args.heartbeat_ms > 0).then(|| Duration::from_millis(args.heartbeat_ms)),
            replay_timeout: Duration::from_secs(2),
            credentials,
        })
    }

    /// What may be a mistake but can work, for the log at start. An empty worker address is
    /// allowed because a router may know the worker by its id (`MatchExternalKv` answers name
    /// it), but prefix queries (`MatchExternalKvPrefix`, what kv-indexer-router and the
    /// upstream cache-aware router ask) leave such a worker out: it is never routed to for its
    /// cache.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.worker_address.trim().is_empty() {
            warnings.push(format!(
                "KV_INDEXER_WORKER_ADDRESS (--worker-address) is empty: prefix queries leave worker {:?} out, so routers asking them never route to it for its cache; set it to the worker's URL exactly as the router lists it (e.g. http://10.0.0.5:30000)",
                self.worker_id
            ));
        }
        warnings
    }
}

/// The cache spec sent with every request; `None` for a legacy worker.
fn cache_spec(args: &Args) -> Result<Option<CacheSpec>, ConfigError> {
    if args.cache_spec_version > 1 {
        return Err(ConfigError::SpecVersion(args.cache_spec_version));
    }
    let Some(Components(components)) = args.cache_components else {
        return Ok(None);
    };
    if args.engine == Engine::Vllm {
        return Err(ConfigError::VllmComponents);
    }
    let swa_window_tokens = match (components & COMPONENT_SWA != 0, args.swa_window_tokens) {
        (true, Some(0) | None) => return Err(ConfigError::SwaWindow),
        (true, Some(window)) => window,
        (false, _) => 0,
    };
    Ok(Some(CacheSpec {
        version: args.cache_spec_version,
        components,
        swa_window_tokens,
        full_tier_mask: args.full_tiers.mask(),
        swa_tier_mask: args.swa_tiers.mask(),
        mamba_tier_mask: args.mamba_tiers.mask(),
    }))
}

fn check_zmq_endpoint(setting: &'static str, endpoint: &str) -> Result<(), ConfigError> {
    let connectable = endpoint.strip_prefix("tcp://").is_some_and(|rest| {
        !rest.contains('*')
            && rest.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
            })
    });
    if !connectable {
        return Err(ConfigError::ZmqEndpoint {
            setting,
            endpoint: endpoint.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use kv_indexer_client::client::error_chain;

    use super::*;

    fn config(argv: &[&str]) -> Result<BridgeConfig, String> {
        let mut full = vec!["kv-indexer-bridge"];
        full.extend_from_slice(argv);
        let args = Args::try_parse_from(full).map_err(|e| e.to_string())?;
        BridgeConfig::from_args(args).map_err(|error| error_chain(&error))
    }

    fn check_err(argv: &[&str], needle: &str) {
        match config(argv) {
            Ok(config) => panic!("{argv:?} was accepted: {config:?}"),
            Err(error) => assert!(error.contains(needle), "{error:?} does not name {needle:?}"),
        }
    }

    #[test]
    fn defaults_make_a_legacy_worker_clearing_every_tier() {
        let config = config(&["--worker-id", "w"]).unwrap();
        assert_eq!(config.cache_spec, None);
        assert_eq!(config.clear_tiers, [Tier::Hbm, Tier::Dram, Tier::Ssd]);
        assert_eq!(config.endpoints, ["http://[::1]:50051"]);
        assert_eq!(config.queue_batches, 10_000);
        assert!(config.replay_endpoint.is_none());
    }

    #[test]
    fn an_endpoint_list_is_a_fleet_tried_in_order_and_each_entry_is_checked() {
        let config = config(&["--worker-id", "w", "--endpoint", "http://a:1, http://b:2"]).unwrap();
        assert_eq!(config.endpoints, ["http://a:1", "http://b:2"]);
        check_err(
            &["--worker-id", "w", "--endpoint", "http://a:1,b:2"],
            "KV_INDEXER_ENDPOINT",
        );
    }

    #[test]
    fn builds_a_swa_spec_with_tier_masks() {
        let config = config(&[
            "--worker-id",
            "w",
            "--cache-components",
            "full,swa",
            "--swa-window-tokens",
            "4096",
            "--swa-tiers",
            "GPU",
            "--full-tiers",
            "hbm,cpu_pinned",
        ])
        .unwrap();
        assert_eq!(
            config.cache_spec,
            Some(CacheSpec {
                version: 1,
                components: COMPONENT_FULL | COMPONENT_SWA,
                swa_window_tokens: 4096,
                full_tier_mask: 2 | 4,
                swa_tier_mask: 2,
                mamba_tier_mask: 2 | 4,
            })
        );
    }

    #[test]
    fn full_is_implied_by_mamba() {
        let config = config(&["--worker-id", "w", "--cache-components", "mamba"]).unwrap();
        assert_eq!(
            config.cache_spec.unwrap().components,
            COMPONENT_FULL | COMPONENT_MAMBA
        );
    }

    #[test]
    fn rejects_tls_settings_that_cannot_work() {
        check_err(
            &["--worker-id", "w", "--indexer-ca", "/nonexistent/ca.pem"],
            "reading KV_INDEXER_TLS_CA \"/nonexistent/ca.pem\"",
        );
        check_err(
            &["--worker-id", "w", "--indexer-tls-domain", "indexer"],
            "KV_INDEXER_ENDPOINT (--endpoint): TLS options (CA, client certificate, TLS domain) are given but endpoint http://[::1]:50051 is not https://",
        );
        check_err(
            &["--worker-id", "w", "--indexer-token", "a b"],
            "KV_INDEXER_TOKEN (--indexer-token): the Indexer token must be visible ASCII",
        );
    }

    #[test]
    fn rejects_bad_values_naming_the_variable() {
        check_err(&[], "--worker-id");
        check_err(
            &["--worker-id", " "],
            "KV_INDEXER_WORKER_ID (--worker-id) must not be empty",
        );
        // Each after `--worker-id w`.
        for (flags, needle) in [
            (
                "--clear-tiers HBM,TAPE",
                "--clear-tiers <CLEAR_TIERS>': unknown tier \"TAPE\"",
            ),
            (
                "--cache-components full,lru",
                "--cache-components <CACHE_COMPONENTS>': unknown component \"lru\"",
            ),
            (
                "--cache-components swa,mamba",
                "swa and mamba together are not a supported cache",
            ),
            (
                "--cache-components full,swa",
                "KV_INDEXER_SWA_WINDOW_TOKENS",
            ),
            (
                "--cache-components full,swa --swa-window-tokens 0",
                "KV_INDEXER_SWA_WINDOW_TOKENS",
            ),
            ("--endpoint [::1]:50051", "KV_INDEXER_ENDPOINT"),
            ("--event-endpoint tcp://*:5557", "SGLANG_KV_EVENT_ENDPOINT"),
            ("--replay-endpoint ipc:///x", "SGLANG_KV_REPLAY_ENDPOINT"),
            ("--cache-spec-version 2", "KV_INDEXER_CACHE_SPEC_VERSION"),
            ("--queue-batches 0", "--queue-batches"),
            ("--heartbeat-ms soon", "--heartbeat-ms"),
        ] {
            let mut argv = vec!["--worker-id", "w"];
            argv.extend(flags.split(' '));
            check_err(&argv, needle);
        }
    }

    #[test]
    fn warns_about_an_empty_worker_address_only() {
        for (argv, expected) in [
            (&["--worker-id", "w"][..], 1),
            (&["--worker-id", "w", "--worker-address", " "][..], 1),
            (
                &["--worker-id", "w", "--worker-address", "http://w:30000"][..],
                0,
            ),
        ] {
            let warnings = config(argv).unwrap().warnings();
            assert_eq!(warnings.len(), expected, "{argv:?}: {warnings:?}");
            for warning in warnings {
                assert!(
                    warning.contains("KV_INDEXER_WORKER_ADDRESS (--worker-address) is empty"),
                    "{warning}"
                );
            }
        }
    }

    #[test]
    fn a_security_error_keeps_its_source() {
        let argv = [
            "kv-indexer-bridge",
            "--worker-id",
            "w",
            "--indexer-token",
            "a b",
        ];
        let error = BridgeConfig::from_args(Args::try_parse_from(argv).unwrap()).unwrap_err();
        assert!(
            matches!(
                error,
                ConfigError::Security {
                    setting: "KV_INDEXER_TOKEN (--indexer-token)",
                    source: SecurityError::BadToken,
                }
            ),
            "{error:?}"
        );
        assert_eq!(
            error_chain(&error),
            "KV_INDEXER_TOKEN (--indexer-token): the Indexer token must be visible ASCII without spaces",
            "the message names the setting once and the cause once"
        );
    }
}
