//! What the state keeps per worker beside the index (fencing and liveness), and the liveness
//! rules: which workers a sweep expires, and the fresh TTL a restart gives.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::error::ChangeError;

/// What the server keeps per worker beside the index: fencing and liveness.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerMeta {
    /// The highest bridge incarnation seen for the worker (0: none sent).
    pub incarnation: u64,
    /// The newest batch number applied from that incarnation (0: none numbered).
    pub batch: u64,
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
fn fence(meta: &Meta, worker_id: &str, incarnation: Option<u64>) -> Result<(), ChangeError> {
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

/// What the sequence gate makes of an apply that passed the fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// The next batch of its incarnation, or not numbered: apply it.
    Next,
    /// A batch of its incarnation already applied (a retry): acknowledge it, apply nothing.
    Duplicate,
    /// A later batch than the next: the batches between, which were acknowledged, are lost
    /// (a rolled-back log or state directory). The worker is cleared and its bridge re-syncs.
    Gap { expected: u64 },
}

/// Fences an apply and passes it through the sequence gate, noting its incarnation and batch
/// number in `meta` at once (so that a later apply in the same group is judged after it). The
/// one rule the writer, replay and every replica apply alike, in log order.
///
/// A batch number counts the applies of one bridge incarnation from 1 with no gap; it needs an
/// incarnation. An apply without a number passes as it did before numbers.
pub fn admit(
    meta: &mut Meta,
    worker_id: &str,
    incarnation: Option<u64>,
    batch: Option<u64>,
) -> Result<Gate, ChangeError> {
    fence(meta, worker_id, incarnation)?;
    let bad = |why| ChangeError::BadBatch {
        worker_id: worker_id.to_owned(),
        why,
    };
    match (incarnation, batch) {
        (None, Some(_)) => return Err(bad("a batch number needs a bridge incarnation")),
        (_, Some(0)) => return Err(bad("batch numbers start at 1")),
        _ => {}
    }
    // A worker the index does not know holds nothing here to over-claim: its first apply,
    // whatever its number, is the base the next one follows (an index that started empty takes
    // a bridge's queued batches as they come).
    let known = meta.contains_key(worker_id);
    let entry = worker_meta(meta, worker_id);
    let Some(incarnation) = incarnation else {
        return Ok(Gate::Next);
    };
    if !known && let Some(batch) = batch {
        entry.incarnation = incarnation;
        entry.batch = batch;
        return Ok(Gate::Next);
    }
    if incarnation > entry.incarnation {
        entry.incarnation = incarnation;
        entry.batch = 0;
    }
    let Some(batch) = batch else {
        return Ok(Gate::Next);
    };
    let expected = entry.batch + 1;
    let gate = match batch.cmp(&expected) {
        std::cmp::Ordering::Less => return Ok(Gate::Duplicate),
        std::cmp::Ordering::Equal => Gate::Next,
        std::cmp::Ordering::Greater => Gate::Gap { expected },
    };
    entry.batch = batch;
    Ok(gate)
}

/// For how many TTLs the mass-expiry guard refuses, without a break, before it gives way: long
/// enough to ride out a partition, short enough that a lone worker that died (a fleet of one,
/// or the last one left) is not claimed forever. Timed on a monotonic clock from the first
/// refusal, so a paused host or a clock jump that makes every worker look silent at once is
/// refused as before: the bridges' next heartbeats end the episode.
pub const MASS_EXPIRY_BOUND_TTLS: u32 = 10;

/// The mass-expiry guard's memory: the refusals of the current episode (every sweep since the
/// first that would have expired every live worker).
#[derive(Debug, Default)]
pub struct ExpiryGuard {
    refusing_since: Option<Instant>,
    refusals: u64,
}

/// The live workers of `meta` whose TTL ran out at `now_ms` (wall clock, as `last_seen_ms`),
/// each with the last-seen time it had, by name; none when that would be every live worker (a
/// partition, a paused host, a clock jump?), which is counted and logged instead, until the
/// guard has refused for [`MASS_EXPIRY_BOUND_TTLS`] TTLs by the monotonic clock (`now`).
pub fn due_for_expiry(
    meta: &Meta,
    ttl: Duration,
    now_ms: u64,
    now: Instant,
    guard: &mut ExpiryGuard,
) -> Vec<(String, u64)> {
    let ttl_ms = ttl.as_millis() as u64;
    let live = meta.values().filter(|meta| !meta.expired).count();
    let mut expired: Vec<(String, u64)> = meta
        .iter()
        .filter(|(_, meta)| !meta.expired && now_ms.saturating_sub(meta.last_seen_ms) > ttl_ms)
        .map(|(id, meta)| (id.clone(), meta.last_seen_ms))
        .collect();
    if expired.len() < live || live == 0 {
        *guard = ExpiryGuard::default();
    } else {
        let since = *guard.refusing_since.get_or_insert(now);
        if now.saturating_duration_since(since) < ttl * MASS_EXPIRY_BOUND_TTLS {
            guard.refusals += 1;
            crate::observe::mass_expiry_refused();
            // Logged at the 1st, 2nd, 4th, … refusal of the episode: a sweep runs every few seconds.
            if guard.refusals.is_power_of_two() {
                tracing::warn!(
                    workers = live,
                    ttl_s = ttl.as_secs_f64(),
                    refusals = guard.refusals,
                    "every live worker's TTL ran out in one sweep (a partition, a paused host, a clock jump?): expiring none unless this lasts {MASS_EXPIRY_BOUND_TTLS} TTLs"
                );
            }
            return Vec::new();
        }
        tracing::warn!(
            workers = live,
            refused_for_s = now.saturating_duration_since(since).as_secs_f64(),
            "every live worker has stayed silent for {MASS_EXPIRY_BOUND_TTLS} TTLs of refusals: expiring them after all (a lone dead worker, or a partition too long for its cache signal to be trusted)"
        );
        *guard = ExpiryGuard::default();
    }
    if expired.is_empty() {
        return expired;
    }
    expired.sort();
    let names: Vec<&str> = expired.iter().map(|(id, _)| id.as_str()).collect();
    tracing::info!(workers = ?names, ttl_s = ttl.as_secs_f64(), "expiring workers with no apply within their TTL");
    crate::observe::workers_expired(expired.len());
    expired
}

/// Workers seen and not expired: `kv_indexer_workers`.
pub fn live_workers(meta: &Meta) -> usize {
    meta.values().filter(|entry| !entry.expired).count()
}

/// Gives every known, unexpired worker a fresh TTL from `now_ms`: a restarted server neither
/// expires every worker at once nor keeps a dead one forever.
pub fn fresh_ttl(meta: &mut Meta, now_ms: u64) {
    for entry in meta.values_mut() {
        entry.last_seen_ms = entry.last_seen_ms.max(now_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gate's answer to each apply of `steps` (incarnation, batch), from an empty meta.
    fn check(steps: &[(Option<u64>, Option<u64>)], want: &[Result<Gate, &str>]) {
        let mut meta = Meta::new();
        for (step, want) in steps.iter().zip(want) {
            let got = admit(&mut meta, "w", step.0, step.1).map_err(|e| match e {
                ChangeError::Fenced { .. } => "fenced",
                ChangeError::BadBatch { .. } => "bad",
                _ => "other",
            });
            assert_eq!(&got, want, "step {step:?} after {meta:?}");
        }
    }

    fn seen_at(workers: &[(&str, u64)]) -> Meta {
        workers
            .iter()
            .map(|&(id, last_seen_ms)| {
                let entry = WorkerMeta {
                    last_seen_ms,
                    ..WorkerMeta::default()
                };
                (id.to_string(), entry)
            })
            .collect()
    }

    #[test]
    fn expiry_spares_every_live_worker_at_once_until_the_guard_has_refused_for_the_bound() {
        let ttl = Duration::from_secs(30);
        let start = Instant::now();
        let mut guard = ExpiryGuard::default();
        // One silent among two live: expired.
        let meta = seen_at(&[("dead", 0), ("alive", 100_000)]);
        let due = due_for_expiry(&meta, ttl, 100_000, start, &mut guard);
        assert_eq!(due, [("dead".to_string(), 0)]);
        assert_eq!(live_workers(&meta), 2);
        // A lone worker silent for far longer than the bound by the wall clock (a paused
        // host, a clock jump): refused, and the episode starts now.
        let meta = seen_at(&[("lone", 0)]);
        let wall = 3_600_000;
        assert!(due_for_expiry(&meta, ttl, wall, start, &mut guard).is_empty());
        assert_eq!(guard.refusals, 1);
        // Still refused until the guard has refused for 10 TTLs by the monotonic clock.
        let bound = ttl * MASS_EXPIRY_BOUND_TTLS;
        let just_before = start + bound - Duration::from_millis(1);
        assert!(due_for_expiry(&meta, ttl, wall, just_before, &mut guard).is_empty());
        assert_eq!(guard.refusals, 2);
        let due = due_for_expiry(&meta, ttl, wall, start + bound, &mut guard);
        assert_eq!(due, [("lone".to_string(), 0)]);
        assert_eq!(guard.refusals, 0, "the episode ends");
        // A worker heard from ends an episode: the next refusal starts a new one.
        let mut guard = ExpiryGuard::default();
        let two = seen_at(&[("a", 0), ("b", 0)]);
        assert!(due_for_expiry(&two, ttl, wall, start, &mut guard).is_empty());
        let back = seen_at(&[("a", 0), ("b", wall)]);
        due_for_expiry(&back, ttl, wall, start + bound, &mut guard);
        assert!(due_for_expiry(&two, ttl, wall, start + bound, &mut guard).is_empty());
        assert_eq!(guard.refusals, 1);
        // Expired workers are not live.
        let mut meta = seen_at(&[("a", 0), ("b", 0)]);
        meta.get_mut("a").unwrap().expired = true;
        assert_eq!(live_workers(&meta), 1);
    }

    const NEXT: Result<Gate, &str> = Ok(Gate::Next);
    const DUP: Result<Gate, &str> = Ok(Gate::Duplicate);

    #[test]
    fn the_next_batch_applies_and_a_retry_is_a_duplicate() {
        let steps = [(Some(7), Some(1)), (Some(7), Some(2)), (Some(7), Some(2))];
        check(&steps, &[NEXT, NEXT, DUP]);
        let steps = [(Some(7), Some(1)), (Some(7), Some(2)), (Some(7), Some(1))];
        check(&steps, &[NEXT, NEXT, DUP]);
    }

    #[test]
    fn a_later_batch_than_the_next_is_a_gap_and_the_one_after_it_is_next() {
        let steps = [(Some(7), Some(1)), (Some(7), Some(5)), (Some(7), Some(6))];
        check(&steps, &[NEXT, Ok(Gate::Gap { expected: 2 }), NEXT]);
        let steps = [(None, None), (Some(7), Some(5))];
        check(&steps, &[NEXT, Ok(Gate::Gap { expected: 1 })]);
    }

    #[test]
    fn a_new_incarnation_starts_at_one_and_mid_sequence_is_a_gap_for_a_known_worker() {
        let steps = [(Some(7), Some(1)), (Some(8), Some(3)), (Some(8), Some(4))];
        check(&steps, &[NEXT, Ok(Gate::Gap { expected: 1 }), NEXT]);
        let steps = [(Some(7), Some(1)), (Some(8), Some(1)), (Some(8), Some(2))];
        check(&steps, &[NEXT, NEXT, NEXT]);
    }

    #[test]
    fn an_unknown_worker_mid_sequence_is_taken_as_the_base() {
        // An index that started empty: nothing of the worker's to over-claim.
        let steps = [(Some(7), Some(9)), (Some(7), Some(10)), (Some(7), Some(12))];
        check(&steps, &[NEXT, NEXT, Ok(Gate::Gap { expected: 11 })]);
    }

    #[test]
    fn an_old_incarnation_is_fenced_whatever_its_number() {
        let steps = [(Some(8), Some(1)), (Some(7), Some(2)), (Some(7), Some(1))];
        check(&steps, &[NEXT, Err("fenced"), Err("fenced")]);
    }

    #[test]
    fn unnumbered_applies_pass_as_before_and_bad_numbers_are_refused() {
        let steps = [
            (None, None),
            (Some(7), None),
            (Some(7), None),
            (None, Some(1)),
        ];
        check(&steps, &[NEXT, NEXT, NEXT, Err("bad")]);
        check(&[(Some(7), Some(0))], &[Err("bad")]);
        check(
            &[(Some(7), Some(1)), (Some(8), Some(0)), (Some(7), Some(2))],
            &[NEXT, Err("bad"), NEXT],
        );
    }

    #[test]
    fn a_refused_apply_changes_nothing() {
        let mut meta = Meta::new();
        admit(&mut meta, "w", Some(8), Some(1)).unwrap();
        let before = meta.clone();
        assert!(admit(&mut meta, "w", Some(7), Some(2)).is_err());
        assert!(admit(&mut meta, "w", Some(8), Some(0)).is_err());
        assert!(matches!(
            admit(&mut meta, "w", Some(8), Some(1)),
            Ok(Gate::Duplicate)
        ));
        assert_eq!(meta, before);
    }
}
