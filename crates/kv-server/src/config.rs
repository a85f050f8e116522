//! Server configuration: every setting is a `--flag` and its documented environment variable.

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::path::PathBuf;

use std::time::Duration;

use clap::Parser;
use kv_common::{Secret, read_pem};

use kv_state::config::{FleetConfig, SnapshotMethod, StateConfig, SyncPolicy};
use kv_state::stream::{StreamConfig, StreamConfigError};

use crate::access::{Access, AccessConfig, AccessError};

/// The KV-cache Indexer gRPC server.
#[derive(Debug, Clone, Parser)]
#[command(name = "kv-indexer-server", version, about)]
pub struct Args {
    /// Address the gRPC service listens on.
    #[arg(long, env = "KV_INDEXER_LISTEN_ADDR", default_value = "[::1]:50051")]
    pub listen_addr: SocketAddr,

    /// A second address, served by a thread of its own, for the bridges: their applies keep
    /// their latency when queries saturate the main address's CPU (both serve every RPC).
    #[arg(long, env = "KV_INDEXER_APPLY_LISTEN_ADDR")]
    pub apply_listen_addr: Option<SocketAddr>,

    /// Prefix queries executing at once; one more is rejected with RESOURCE_EXHAUSTED.
    #[arg(
        long,
        env = "KV_INDEXER_PREFIX_QUERY_MAX_INFLIGHT",
        default_value = "32"
    )]
    pub prefix_query_max_inflight: NonZeroUsize,

    /// Threads that run prefix scans, below the priority of the threads serving HTTP/2
    /// (default: one per CPU this process may run on).
    #[arg(long, env = "KV_INDEXER_QUERY_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub query_threads: Option<u16>,

    /// Connections the listen address serves at once; a new one beyond is closed at once
    /// (default: no bound). The apply address is never bounded.
    #[arg(long, env = "KV_INDEXER_MAX_CONNECTIONS")]
    pub max_connections: Option<NonZeroUsize>,

    /// HTTP/2 streams one connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS):
    /// a client queues its further calls; a stream beyond is reset with REFUSED_STREAM.
    #[arg(long, env = "KV_INDEXER_MAX_CONCURRENT_STREAMS", default_value = "64")]
    pub max_concurrent_streams: NonZeroU32,

    /// Address of the admin HTTP server serving Prometheus metrics on /metrics (off when unset).
    #[arg(long, env = "KV_INDEXER_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,

    /// PEM certificate chain of the server; with the key, the listener speaks TLS only.
    #[arg(long, env = "KV_INDEXER_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of that certificate.
    #[arg(long, env = "KV_INDEXER_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA certificate(s): when set, every client must present a certificate they signed
    /// (mutual TLS).
    #[arg(long, env = "KV_INDEXER_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,

    /// Bearer token ApplyExternalKvBatch must carry (applies are open when unset).
    #[arg(long, env = "KV_INDEXER_WRITE_TOKEN", hide_env_values = true)]
    pub write_token: Option<Secret>,

    /// Bearer token the queries must carry, the write token also accepted (open when unset).
    #[arg(long, env = "KV_INDEXER_READ_TOKEN", hide_env_values = true)]
    pub read_token: Option<Secret>,

    /// Directory of the durable state (log and snapshots); unset: in memory only, a restart
    /// starts empty. One live server per directory.
    #[arg(long, env = "KV_INDEXER_STATE_DIR")]
    pub state_dir: Option<PathBuf>,

    /// Seconds between snapshots of the state (with a state directory); one is also written
    /// at SIGINT/SIGTERM. 0: only then.
    #[arg(long, env = "KV_INDEXER_SNAPSHOT_INTERVAL_S", default_value = "60")]
    pub snapshot_interval_s: u64,

    /// How periodic snapshots are written: `fork` (a child process writes the live index
    /// copy-on-write and builds its own block table: no stall after the fork, about 1.8x the
    /// index's memory at the peak), `fork-shared` (the table shared too: memory near the
    /// index's size, applies stall on copy-on-write faults after each fork) or `rebuild` (a
    /// thread rebuilds the state from the previous snapshot and the log: no pause, a second
    /// index in memory while it runs). Either fork falls back to `rebuild` when no child can
    /// be made.
    #[arg(
        long,
        env = "KV_INDEXER_SNAPSHOT_METHOD",
        value_enum,
        default_value = "fork"
    )]
    pub snapshot_method: SnapshotMethod,

    /// When an accepted apply is durable: `always` (fdatasync before the answer), `batch`
    /// (written before the answer, fdatasync within 5 ms), `off` (no fdatasync between
    /// snapshots).
    #[arg(long, env = "KV_INDEXER_LOG_SYNC", value_enum, default_value = "batch")]
    pub log_sync: SyncPolicy,

    /// Seconds without an apply (a batch or a bridge heartbeat) after which a worker's
    /// placements are purged; 0: never.
    #[arg(long, env = "KV_INDEXER_WORKER_TTL_S", default_value = "30")]
    pub worker_ttl_s: u64,

    /// When the state directory's snapshot or log is corrupt, move the files aside and start
    /// empty instead of refusing to start.
    /// The flag alone means true; a value (the variable's too) may be 1/0, true/false,
    /// yes/no or on/off.
    #[arg(
        long,
        env = "KV_INDEXER_DISCARD_CORRUPT_STATE",
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_value = "false",
        default_missing_value = "true"
    )]
    pub discard_corrupt_state: bool,

    /// Seconds a shutdown (SIGINT, SIGTERM) waits for open connections to finish their calls
    /// before it drops them.
    #[arg(long, env = "KV_INDEXER_DRAIN_TIMEOUT_S", default_value = "10")]
    pub drain_timeout_s: u64,

    /// A shared log on Redis/Valkey (`redis://host:port/db`, `rediss://` for TLS): every
    /// replica appends accepted changes to one stream and applies the whole stream in order,
    /// so replicas converge. Unset: this server's own log (or memory).
    #[arg(long, env = "KV_INDEXER_EVENT_LOG")]
    pub event_log: Option<String>,

    /// The stream's key; the keys beside it share the prefix.
    #[arg(
        long,
        env = "KV_INDEXER_EVENT_LOG_KEY",
        default_value = "sgl-kv-indexer:events"
    )]
    pub event_log_key: String,

    /// Password for the shared log (replaces one in the URL).
    #[arg(long, env = "KV_INDEXER_EVENT_LOG_PASSWORD", hide_env_values = true)]
    pub event_log_password: Option<Secret>,

    /// PEM CA that signs the shared log's TLS certificate (`rediss://`), instead of the
    /// system's roots.
    #[arg(long, env = "KV_INDEXER_EVENT_LOG_TLS_CA")]
    pub event_log_tls_ca: Option<PathBuf>,

    /// With a shared log: Redis replicas that must hold an append (`WAIT`, at most 1 s) before
    /// it is answered; fewer is UNAVAILABLE (the bridge retries). 0: answered once the primary
    /// has it (a failover may then drop the last acknowledged changes).
    #[arg(long, env = "KV_INDEXER_EVENT_LOG_MIN_REPLICAS", default_value = "0")]
    pub event_log_min_replicas: u32,

    /// With a shared log: a replica further behind the stream than this answers queries
    /// UNAVAILABLE (routers try the next endpoint) instead of answering from a stale index.
    #[arg(long, env = "KV_INDEXER_MAX_LAG_MS", default_value = "1000")]
    pub max_lag_ms: u64,
}

/// A setting that does not hold.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Pem(#[from] kv_common::PemError),
    #[error(transparent)]
    Access(#[from] AccessError),
    #[error(transparent)]
    EventLog(#[from] StreamConfigError),
}

/// What one listener lets its clients hold at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections served at once (`None`: no bound); a new one beyond is closed at once.
    pub max_connections: Option<usize>,
    /// HTTP/2 streams open at once on one connection.
    pub max_concurrent_streams: u32,
}

impl Default for ConnectionLimits {
    fn default() -> ConnectionLimits {
        ConnectionLimits {
            max_connections: None,
            max_concurrent_streams: MAX_CONCURRENT_STREAMS,
        }
    }
}

/// The validated settings the service runs with. The access settings (TLS, tokens) are part
/// of it, so a server cannot be started without the ones configured.
#[derive(Debug, Clone)]
pub struct Config {
    pub prefix_query_max_inflight: usize,
    /// Threads running prefix scans (`crate::pool`).
    pub query_threads: usize,
    /// The listen address's connection limits (the apply address has none but the streams').
    pub connections: ConnectionLimits,
    /// TLS and tokens, read and checked; open (plain, no tokens) by default.
    pub access: Access,
    /// How long a shutdown waits for open connections to finish before it drops them.
    pub drain_timeout: Duration,
    /// Where the state lives and how it is kept (memory, a directory, a shared log).
    pub state: StateConfig,
}

/// The default of [`Config::drain_timeout`].
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// The default of [`ConnectionLimits::max_concurrent_streams`].
pub const MAX_CONCURRENT_STREAMS: u32 = 64;

/// The default of [`Config::query_threads`]: one per CPU this process may run on.
pub fn default_query_threads() -> usize {
    std::thread::available_parallelism().map_or(1, NonZeroUsize::get)
}

impl Default for Config {
    fn default() -> Config {
        Config {
            prefix_query_max_inflight: 32,
            query_threads: default_query_threads(),
            connections: ConnectionLimits::default(),
            access: Access::default(),
            drain_timeout: DRAIN_TIMEOUT,
            state: StateConfig::default(),
        }
    }
}

impl Config {
    /// The settings of `args`, with the certificate files and tokens they name read and checked.
    pub fn from_args(args: &Args) -> Result<Config, ConfigError> {
        let fleet = match &args.event_log {
            None => None,
            Some(url) => Some(FleetConfig {
                stream: event_log(url, args)?,
                max_lag: Duration::from_millis(args.max_lag_ms),
            }),
        };
        Ok(Config {
            prefix_query_max_inflight: args.prefix_query_max_inflight.get(),
            query_threads: args
                .query_threads
                .map_or_else(default_query_threads, usize::from),
            connections: ConnectionLimits {
                max_connections: args.max_connections.map(NonZeroUsize::get),
                max_concurrent_streams: args.max_concurrent_streams.get(),
            },
            access: Access::from_settings(&AccessConfig {
                tls_cert: args.tls_cert.as_deref(),
                tls_key: args.tls_key.as_deref(),
                tls_client_ca: args.tls_client_ca.as_deref(),
                write_token: args.write_token.as_ref().map(Secret::expose),
                read_token: args.read_token.as_ref().map(Secret::expose),
            })?,
            drain_timeout: Duration::from_secs(args.drain_timeout_s),
            state: StateConfig {
                dir: args.state_dir.clone(),
                sync: args.log_sync,
                worker_ttl: seconds(args.worker_ttl_s),
                snapshot_interval: seconds(args.snapshot_interval_s),
                snapshot_method: args.snapshot_method,
                discard_corrupt: args.discard_corrupt_state,
                fleet,
                clock: Default::default(),
            },
        })
    }
}

/// The shared log `url` with the password, CA and replica count `args` give.
fn event_log(url: &str, args: &Args) -> Result<StreamConfig, ConfigError> {
    let password = args.event_log_password.as_ref().map(|p| p.expose());
    let stream = StreamConfig::new(url, &args.event_log_key, password)?
        .with_min_replicas(args.event_log_min_replicas);
    Ok(match &args.event_log_tls_ca {
        Some(path) => stream.with_tls_ca(read_pem(
            "KV_INDEXER_EVENT_LOG_TLS_CA",
            path,
            "CERTIFICATE",
        )?)?,
        None => stream,
    })
}

/// A number of seconds as a duration, 0 as none.
fn seconds(value: u64) -> Option<Duration> {
    (value > 0).then(|| Duration::from_secs(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a parsed command line should give.
    #[derive(Debug)]
    struct Want {
        addr: &'static str,
        inflight: usize,
        query_threads: usize,
        connections: ConnectionLimits,
    }

    impl Default for Want {
        fn default() -> Want {
            Want {
                addr: "[::1]:50051",
                inflight: 32,
                query_threads: default_query_threads(),
                connections: ConnectionLimits {
                    max_connections: None,
                    max_concurrent_streams: 64,
                },
            }
        }
    }

    fn check(argv: &[&str], expect: Result<Want, &str>) {
        let mut full = vec!["kv-indexer-server"];
        full.extend_from_slice(argv);
        match (Args::try_parse_from(full), expect) {
            (Ok(args), Ok(want)) => {
                assert_eq!(args.listen_addr.to_string(), want.addr);
                let config = Config::from_args(&args).unwrap();
                assert_eq!(config.prefix_query_max_inflight, want.inflight);
                assert_eq!(config.query_threads, want.query_threads);
                assert_eq!(config.connections, want.connections);
            }
            (Err(error), Err(needle)) => {
                let text = error.to_string();
                assert!(text.contains(needle), "{text:?} does not name {needle:?}");
            }
            (got, want) => panic!("argv {argv:?}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn defaults_match_the_contract() {
        check(&[], Ok(Want::default()));
    }

    #[test]
    fn flags_override_defaults() {
        check(
            &[
                "--listen-addr",
                "127.0.0.1:6000",
                "--prefix-query-max-inflight",
                "4",
                "--query-threads",
                "3",
                "--max-connections",
                "16",
                "--max-concurrent-streams",
                "8",
            ],
            Ok(Want {
                addr: "127.0.0.1:6000",
                inflight: 4,
                query_threads: 3,
                connections: ConnectionLimits {
                    max_connections: Some(16),
                    max_concurrent_streams: 8,
                },
            }),
        );
    }

    #[test]
    fn a_boolean_takes_the_usual_spellings_and_the_flag_alone_is_true() {
        let parse = |argv: &[&str]| {
            let mut full = vec!["kv-indexer-server"];
            full.extend_from_slice(argv);
            Args::try_parse_from(full).map(|args| args.discard_corrupt_state)
        };
        assert!(!parse(&[]).unwrap());
        assert!(parse(&["--discard-corrupt-state"]).unwrap());
        for (value, want) in [("1", true), ("yes", true), ("on", true), ("true", true)]
            .into_iter()
            .chain([
                ("0", false),
                ("no", false),
                ("off", false),
                ("false", false),
            ])
        {
            let got = parse(&["--discard-corrupt-state", value]).unwrap();
            assert_eq!(got, want, "{value}");
        }
        assert!(parse(&["--discard-corrupt-state", "maybe"]).is_err());
    }

    #[test]
    fn rejects_bad_overload_settings_naming_them() {
        for (flag, value) in [
            ("--query-threads", "0"),
            ("--query-threads", "1025"),
            ("--max-connections", "0"),
            ("--max-connections", "many"),
            ("--max-concurrent-streams", "0"),
            ("--max-concurrent-streams", "4294967296"),
        ] {
            check(&[flag, value], Err(flag));
        }
    }

    #[test]
    fn rejects_a_bad_listen_address_naming_it() {
        check(&["--listen-addr", "nowhere"], Err("--listen-addr"));
    }

    #[test]
    fn rejects_zero_inflight_naming_it() {
        check(
            &["--prefix-query-max-inflight", "0"],
            Err("--prefix-query-max-inflight"),
        );
    }

    #[test]
    fn an_event_log_that_is_not_redis_is_refused_naming_the_setting() {
        let args =
            Args::try_parse_from(["kv-indexer-server", "--event-log", "localhost:6379"]).unwrap();
        let error = Config::from_args(&args).unwrap_err().to_string();
        assert!(error.contains("KV_INDEXER_EVENT_LOG"), "{error}");
    }

    #[test]
    fn help_names_the_environment_variables() {
        let help = <Args as clap::CommandFactory>::command()
            .render_long_help()
            .to_string();
        for var in [
            "KV_INDEXER_LISTEN_ADDR",
            "KV_INDEXER_PREFIX_QUERY_MAX_INFLIGHT",
            "KV_INDEXER_QUERY_THREADS",
            "KV_INDEXER_MAX_CONNECTIONS",
            "KV_INDEXER_MAX_CONCURRENT_STREAMS",
            "KV_INDEXER_METRICS_ADDR",
            "KV_INDEXER_APPLY_LISTEN_ADDR",
            "KV_INDEXER_TLS_CERT",
            "KV_INDEXER_TLS_KEY",
            "KV_INDEXER_TLS_CLIENT_CA",
            "KV_INDEXER_WRITE_TOKEN",
            "KV_INDEXER_DRAIN_TIMEOUT_S",
            "KV_INDEXER_STATE_DIR",
            "KV_INDEXER_SNAPSHOT_INTERVAL_S",
            "KV_INDEXER_LOG_SYNC",
            "KV_INDEXER_SNAPSHOT_METHOD",
            "KV_INDEXER_WORKER_TTL_S",
            "KV_INDEXER_DISCARD_CORRUPT_STATE",
            "KV_INDEXER_READ_TOKEN",
            "KV_INDEXER_EVENT_LOG",
            "KV_INDEXER_EVENT_LOG_KEY",
            "KV_INDEXER_EVENT_LOG_PASSWORD",
            "KV_INDEXER_MAX_LAG_MS",
        ] {
            assert!(help.contains(var), "--help does not mention {var}");
        }
    }
}
