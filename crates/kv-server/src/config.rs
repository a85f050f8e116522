//! Server configuration: every setting is a `--flag` and its documented environment variable.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;

use std::time::Duration;

use clap::Parser;
use kv_common::Secret;

use crate::access::{Access, AccessError};

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

    /// Seconds a shutdown (SIGINT, SIGTERM) waits for open connections to finish their calls
    /// before it drops them.
    #[arg(long, env = "KV_INDEXER_DRAIN_TIMEOUT_S", default_value = "10")]
    pub drain_timeout_s: u64,
}

/// The validated settings the service runs with. The access settings (TLS, tokens) are part
/// of it, so a server cannot be started without the ones configured.
#[derive(Debug, Clone)]
pub struct Config {
    pub prefix_query_max_inflight: usize,
    /// TLS and tokens, read and checked; open (plain, no tokens) by default.
    pub access: Access,
    /// How long a shutdown waits for open connections to finish before it drops them.
    pub drain_timeout: Duration,
}

/// The default of [`Config::drain_timeout`].
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for Config {
    fn default() -> Config {
        Config {
            prefix_query_max_inflight: 32,
            access: Access::default(),
            drain_timeout: DRAIN_TIMEOUT,
        }
    }
}

impl Config {
    /// The settings of `args`, with the certificate files and tokens they name read and checked.
    pub fn from_args(args: &Args) -> Result<Config, AccessError> {
        Ok(Config {
            prefix_query_max_inflight: args.prefix_query_max_inflight.get(),
            access: Access::from_args(args)?,
            drain_timeout: Duration::from_secs(args.drain_timeout_s),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(argv: &[&str], expect: Result<(&str, usize), &str>) {
        let mut full = vec!["kv-indexer-server"];
        full.extend_from_slice(argv);
        match (Args::try_parse_from(full), expect) {
            (Ok(args), Ok((addr, inflight))) => {
                assert_eq!(args.listen_addr.to_string(), addr);
                assert_eq!(
                    Config::from_args(&args).unwrap().prefix_query_max_inflight,
                    inflight
                );
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
        check(&[], Ok(("[::1]:50051", 32)));
    }

    #[test]
    fn flags_override_defaults() {
        check(
            &[
                "--listen-addr",
                "127.0.0.1:6000",
                "--prefix-query-max-inflight",
                "4",
            ],
            Ok(("127.0.0.1:6000", 4)),
        );
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
    fn help_names_the_environment_variables() {
        let help = <Args as clap::CommandFactory>::command()
            .render_long_help()
            .to_string();
        for var in [
            "KV_INDEXER_LISTEN_ADDR",
            "KV_INDEXER_PREFIX_QUERY_MAX_INFLIGHT",
            "KV_INDEXER_METRICS_ADDR",
            "KV_INDEXER_APPLY_LISTEN_ADDR",
            "KV_INDEXER_TLS_CERT",
            "KV_INDEXER_TLS_KEY",
            "KV_INDEXER_TLS_CLIENT_CA",
            "KV_INDEXER_WRITE_TOKEN",
            "KV_INDEXER_DRAIN_TIMEOUT_S",
            "KV_INDEXER_READ_TOKEN",
        ] {
            assert!(help.contains(var), "--help does not mention {var}");
        }
    }
}
