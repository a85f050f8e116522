//! The router's warning classes, each logged at doubling totals.

use kv_common::DoublingLog;

#[derive(Debug, Default)]
pub struct DoublingLogs {
    pub no_usable_match: DoublingLog,
    pub fallback: DoublingLog,
    pub unknown_address: DoublingLog,
}
