//! Series a binary exports from start: each metric described (its `# HELP`) and at 0, so that
//! a dashboard or an alert sees it before its first event. Without a recorder, no-ops.

/// Describes each `(name, help)` counter and exports it at 0.
pub fn counters_from_zero(counters: &[(&'static str, &'static str)]) {
    for &(name, help) in counters {
        metrics::describe_counter!(name, help);
        metrics::counter!(name).absolute(0);
    }
}

/// Describes each `(name, help)` gauge and exports it at 0.
pub fn gauges_from_zero(gauges: &[(&'static str, &'static str)]) {
    for &(name, help) in gauges {
        metrics::describe_gauge!(name, help);
        metrics::gauge!(name).set(0.0);
    }
}
