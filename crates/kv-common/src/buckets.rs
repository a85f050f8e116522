//! Histogram buckets the binaries share (in the base crate, not behind `telemetry`, so that
//! a library that only records metrics can name them).

/// Latency buckets in seconds from 10 µs to 1 s: an in-memory index's answers, seen by its
/// server or a client.
pub const SECONDS_10US_TO_1S: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0,
];

/// Latency buckets in seconds from 1 ms to 60 s: a model server's time to its first answer.
pub const SECONDS_1MS_TO_60S: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
