//! The client's `grpc-timeout` budget, measured from the request's arrival.
//!
//! tonic enforces `grpc-timeout` by dropping the handler and answering CANCELLED; the contract
//! wants DEADLINE_EXCEEDED when the budget is spent before the index is touched, so the server
//! serves connections itself, stamps each request's arrival and checks the budget.

use std::time::{Duration, Instant};

use tonic::metadata::MetadataMap;

/// When a request reached the server (its headers were read), stored in its extensions by the
/// accept loop in `server`.
#[derive(Debug, Clone, Copy)]
pub struct Arrival(pub Instant);

/// Parses a `grpc-timeout` value: at most 8 ASCII digits and one unit of H, M, S, m, u, n.
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at_checked(value.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// The instant by which the client wants its answer, if it sent a valid `grpc-timeout`.
pub fn deadline(metadata: &MetadataMap, arrival: Instant) -> Option<Instant> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    arrival.checked_add(parse_grpc_timeout(value)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(value: &str, expect: Option<Duration>) {
        assert_eq!(parse_grpc_timeout(value), expect, "grpc-timeout {value:?}");
    }

    #[test]
    fn parses_every_unit() {
        check("2H", Some(Duration::from_secs(7200)));
        check("3M", Some(Duration::from_secs(180)));
        check("4S", Some(Duration::from_secs(4)));
        check("251m", Some(Duration::from_millis(251)));
        check("500000u", Some(Duration::from_micros(500_000)));
        check("7n", Some(Duration::from_nanos(7)));
    }

    #[test]
    fn rejects_malformed_values() {
        for bad in ["", "m", "10", "10x", "123456789m", "-1m", "1.5S", "1 m"] {
            check(bad, None);
        }
    }
}
