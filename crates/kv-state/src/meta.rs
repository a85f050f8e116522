//! What the state keeps per worker beside the index (fencing and liveness), and the liveness
//! rules: which workers a sweep expires, and the fresh TTL a restart gives.

use std::collections::HashMap;
use std::time::Duration;

use crate::error::ChangeError;

/// What the server keeps per worker beside the index: fencing and liveness.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerMeta {
    /// The highest bridge incarnation seen for the worker (0: none sent).
    pub incarnation: u64,
    /// Wall-clock time (ms since the Unix epoch) of its last accepted apply.
    pub last_seen_ms: u64,
    /// Its placements were purged for want of applies; cleared by its next apply.
    pub expired: bool,
}

pub type Meta = HashMap<String, WorkerMeta>;

/// The meta of `worker`, added on first sight (the id is copied only then).
pub fn worker_meta<'m>(meta: &'m mut Meta, worker: &str) -> &'m mut WorkerMeta {
    if !meta.contains_key(worker) {
        meta.insert(worker.to_owned(), WorkerMeta::default());
    }
    meta.get_mut(worker).expect("inserted above")
}

/// Refuses an apply from an older bridge incarnation than the worker's newest.
pub fn fence(meta: &Meta, worker_id: &str, incarnation: Option<u64>) -> Result<(), ChangeError> {
    let (Some(incarnation), Some(known)) = (incarnation, meta.get(worker_id)) else {
        return Ok(());
    };
    if incarnation < known.incarnation {
        return Err(ChangeError::Fenced {
            worker_id: worker_id.to_owned(),
            incarnation,
            newest: known.incarnation,
        });
    }
    Ok(())
}

/// The live workers of `meta` whose TTL ran out at `now_ms`, each with the last-seen time it
/// had, by name; none when that would be every live worker (a partition, a paused host, a
/// clock jump?), which is counted in `trips` and logged instead.
pub fn due_for_expiry(
    meta: &Meta,
    ttl: Duration,
    now_ms: u64,
    trips: &mut u64,
) -> Vec<(String, u64)> {
    let ttl_ms = ttl.as_millis() as u64;
    let live = meta.values().filter(|meta| !meta.expired).count();
    let mut expired: Vec<(String, u64)> = meta
        .iter()
        .filter(|(_, meta)| !meta.expired && now_ms.saturating_sub(meta.last_seen_ms) > ttl_ms)
        .map(|(id, meta)| (id.clone(), meta.last_seen_ms))
        .collect();
    if expired.is_empty() {
        return expired;
    }
    if expired.len() == live {
        *trips += 1;
        crate::observe::mass_expiry_refused();
        tracing::warn!(
            workers = live,
            ttl_s = ttl.as_secs_f64(),
            trips = *trips,
            "every live worker's TTL ran out in one sweep (a partition, a paused host, a clock jump?): expiring none"
        );
        return Vec::new();
    }
    expired.sort();
    let names: Vec<&str> = expired.iter().map(|(id, _)| id.as_str()).collect();
    tracing::info!(workers = ?names, ttl_s = ttl.as_secs_f64(), "expiring workers with no apply within their TTL");
    crate::observe::workers_expired(expired.len());
    expired
}

/// Gives every known, unexpired worker a fresh TTL from `now_ms`: a restarted server neither
/// expires every worker at once nor keeps a dead one forever.
pub fn fresh_ttl(meta: &mut Meta, now_ms: u64) {
    for entry in meta.values_mut() {
        entry.last_seen_ms = entry.last_seen_ms.max(now_ms);
    }
}
