//! The records of the log: every accepted change to the index, in the order it was applied.
//!
//! A record is `[kind u8][time_ms u64 LE][body]`:
//! - `1` Apply: the `ApplyExternalKvBatchRequest` as protobuf (it passed validation before it
//!   was logged, and is validated again on replay);
//! - `2` CountHits: the hashes of a `MatchExternalKv` with `count_as_hit`, 8 bytes each;
//! - `3` Expire: the workers whose TTL ran out, as `[count u32][len u32, UTF-8]…`;
//! - `4` ExpireUnseen: the same, each with the last-seen time the decision saw, as
//!   `[count u32]([len u32, UTF-8][last_seen_ms u64])…`: a worker seen later (its apply came
//!   first in the log) is kept. A fleet of replicas uses it, where the log orders the decision
//!   after applies that another replica accepted meanwhile.
//!
//! `time_ms` is the server's wall clock when it accepted the change: replay restores each
//! worker's last-seen time from it.

use kv_indexer_proto::v1 as pb;
use prost::Message;

/// One accepted change.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub time_ms: u64,
    pub change: Change,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    Apply(pb::ApplyExternalKvBatchRequest),
    CountHits(Vec<i64>),
    Expire(Vec<String>),
    ExpireUnseen(Vec<(String, u64)>),
}

/// Why a record's bytes do not decode.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("a record shorter than its header")]
    Short,
    #[error("unknown record kind {0}")]
    Kind(u8),
    #[error("an apply record that is not protobuf")]
    Apply(#[source] prost::DecodeError),
    #[error("a hit-count record whose length is not a multiple of 8")]
    Hashes,
    #[error("an expiry record that does not parse")]
    Expire,
}

const APPLY: u8 = 1;
const COUNT_HITS: u8 = 2;
const EXPIRE: u8 = 3;
const EXPIRE_UNSEEN: u8 = 4;

impl Record {
    /// The bytes of an apply record, from the request as it came (no copy of the request).
    pub fn encode_apply(time_ms: u64, request: &pb::ApplyExternalKvBatchRequest) -> Vec<u8> {
        let mut out = Vec::with_capacity(9 + request.encoded_len());
        out.push(APPLY);
        out.extend_from_slice(&time_ms.to_le_bytes());
        request
            .encode(&mut out)
            .expect("a Vec grows as protobuf needs");
        out
    }

    pub fn encode(&self) -> Vec<u8> {
        if let Change::Apply(request) = &self.change {
            return Record::encode_apply(self.time_ms, request);
        }
        let mut out = Vec::with_capacity(64);
        let kind = match &self.change {
            Change::Apply(_) => APPLY,
            Change::CountHits(_) => COUNT_HITS,
            Change::Expire(_) => EXPIRE,
            Change::ExpireUnseen(_) => EXPIRE_UNSEEN,
        };
        out.push(kind);
        out.extend_from_slice(&self.time_ms.to_le_bytes());
        match &self.change {
            Change::Apply(_) => unreachable!("encoded by encode_apply above"),
            Change::CountHits(hashes) => {
                for hash in hashes {
                    out.extend_from_slice(&hash.to_le_bytes());
                }
            }
            Change::Expire(workers) => {
                out.extend_from_slice(&(workers.len() as u32).to_le_bytes());
                for worker in workers {
                    out.extend_from_slice(&(worker.len() as u32).to_le_bytes());
                    out.extend_from_slice(worker.as_bytes());
                }
            }
            Change::ExpireUnseen(workers) => {
                out.extend_from_slice(&(workers.len() as u32).to_le_bytes());
                for (worker, seen) in workers {
                    out.extend_from_slice(&(worker.len() as u32).to_le_bytes());
                    out.extend_from_slice(worker.as_bytes());
                    out.extend_from_slice(&seen.to_le_bytes());
                }
            }
        }
        out
    }

    /// The hashes the record's REPORT actions name: at most the new blocks applying it adds
    /// (see [`crate::cell::write_for`]).
    pub fn reported_blocks(&self) -> usize {
        match &self.change {
            Change::Apply(request) => request
                .actions
                .iter()
                .filter(|action| action.r#type == kv_index::ActionKind::Report as i32)
                .map(|action| action.hashes.len())
                .sum(),
            Change::CountHits(_) | Change::Expire(_) | Change::ExpireUnseen(_) => 0,
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<Record, RecordError> {
        if bytes.len() < 9 {
            return Err(RecordError::Short);
        }
        let time_ms = u64::from_le_bytes(bytes[1..9].try_into().expect("8 bytes"));
        let body = &bytes[9..];
        let change = match bytes[0] {
            APPLY => Change::Apply(
                pb::ApplyExternalKvBatchRequest::decode(body).map_err(RecordError::Apply)?,
            ),
            COUNT_HITS => {
                if !body.len().is_multiple_of(8) {
                    return Err(RecordError::Hashes);
                }
                Change::CountHits(
                    body.chunks_exact(8)
                        .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                        .collect(),
                )
            }
            EXPIRE => Change::Expire(
                decode_workers(body, false)
                    .ok_or(RecordError::Expire)?
                    .into_iter()
                    .map(|(worker, _)| worker)
                    .collect(),
            ),
            EXPIRE_UNSEEN => {
                Change::ExpireUnseen(decode_workers(body, true).ok_or(RecordError::Expire)?)
            }
            kind => return Err(RecordError::Kind(kind)),
        };
        Ok(Record { time_ms, change })
    }
}

/// `[count u32]([len u32][UTF-8] and, `with_seen`, [u64])…`, as (worker, seen or 0).
fn decode_workers(mut body: &[u8], with_seen: bool) -> Option<Vec<(String, u64)>> {
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, rest) = body.split_at_checked(n)?;
        body = rest;
        Some(head)
    };
    let count = u32::from_le_bytes(take(4)?.try_into().ok()?);
    let mut out = Vec::new();
    for _ in 0..count {
        let len = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
        let worker = String::from_utf8(take(len)?.to_vec()).ok()?;
        let seen = match with_seen {
            true => u64::from_le_bytes(take(8)?.try_into().ok()?),
            false => 0,
        };
        out.push((worker, seen));
    }
    body.is_empty().then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(change: Change) {
        let record = Record {
            time_ms: 1_764_000_000_123,
            change,
        };
        assert_eq!(Record::decode(&record.encode()).unwrap(), record);
    }

    #[test]
    fn every_kind_round_trips() {
        check(Change::Apply(pb::ApplyExternalKvBatchRequest {
            worker_id: "w".into(),
            seq: 7,
            actions: vec![pb::ExternalKvAction {
                r#type: 1,
                tier: 1,
                hashes: vec![i64::MIN, -1, 0, i64::MAX],
                ..Default::default()
            }],
            ..Default::default()
        }));
        check(Change::CountHits(vec![3, -4]));
        check(Change::Expire(vec![
            "a".into(),
            String::new(),
            "wörker".into(),
        ]));
        check(Change::Expire(Vec::new()));
        check(Change::ExpireUnseen(vec![
            ("a".into(), 5),
            ("wörker".into(), u64::MAX),
        ]));
    }

    #[test]
    fn rejects_what_it_did_not_write() {
        assert!(matches!(Record::decode(&[1, 2]), Err(RecordError::Short)));
        assert!(matches!(
            Record::decode(&[9; 12]),
            Err(RecordError::Kind(9))
        ));
        let mut hits = Record {
            time_ms: 0,
            change: Change::CountHits(vec![1]),
        }
        .encode();
        hits.pop();
        assert!(matches!(Record::decode(&hits), Err(RecordError::Hashes)));
        let mut expire = Record {
            time_ms: 0,
            change: Change::Expire(vec!["abc".into()]),
        }
        .encode();
        expire.push(0);
        assert!(matches!(Record::decode(&expire), Err(RecordError::Expire)));
        let mut unseen = Record {
            time_ms: 0,
            change: Change::ExpireUnseen(vec![("abc".into(), 1)]),
        }
        .encode();
        unseen.pop();
        assert!(matches!(Record::decode(&unseen), Err(RecordError::Expire)));
    }
}
