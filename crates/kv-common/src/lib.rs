//! What every binary of the KV Indexer shares (server, bridge, router, simulated worker, tools),
//! and nothing else: no gRPC, no ZMQ, no index.
//!
//! - [`signal`]: SIGINT and SIGTERM, for graceful shutdown;
//! - [`throttle`]: logs at doubling totals, so a sustained stream does not flood them;
//! - [`telemetry`]: the log subscriber and the Prometheus recorder, with its upkeep and its
//!   `/metrics` endpoint;
//! - [`buckets`]: histogram buckets, so that every latency is bucketed alike;
//! - [`series`]: metrics described and exported at 0 from start;
//! - [`secret`]: secret settings that never print, bearer-token syntax and PEM files.

pub mod buckets;
pub mod secret;
pub mod series;
pub mod signal;
#[cfg(feature = "telemetry")]
pub mod telemetry;
pub mod throttle;

pub use secret::{PemError, Secret, is_sendable_token, read_pem};
pub use throttle::DoublingLog;

/// An error and its causes on one line, `: `-separated (for log lines and messages).
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        // Some errors print their source already (redis's I/O errors): not twice.
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        /// Prints its source itself, as redis's I/O errors do.
        #[error("connecting: {0}")]
        Repeats(#[source] std::io::Error),
        #[error("opening the log")]
        Plain(#[source] std::io::Error),
    }

    #[test]
    fn a_cause_is_printed_once() {
        let refused = || std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let text = refused().to_string();
        assert_eq!(
            error_chain(&Outer::Repeats(refused())),
            format!("connecting: {text}")
        );
        assert_eq!(
            error_chain(&Outer::Plain(refused())),
            format!("opening the log: {text}")
        );
    }
}
