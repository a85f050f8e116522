//! gRPC requests into the index, checked against the naive reference model of
//! `crates/kv-index/tests/index/model/reference.rs`. The input is a length-prefixed SGLang msgpack
//! payload (seeded with the captured batches), applied as the bridge would send it, then
//! operations: each is built as the wire message, encoded and decoded with prost (or decoded
//! from raw fuzz bytes), converted as the server converts it, and run on both. Every answer,
//! error and size must be equal, and the index's own invariants must hold after every step.
#![no_main]

#[path = "../../crates/kv-index/tests/index/model/reference.rs"]
#[allow(dead_code)]
mod reference;

use arbitrary::{Arbitrary, Unstructured};
use kv_index::Index;
use kv_indexer_proto::v1 as pb;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use reference::Model;
use kv_indexer_proto::convert;
use sgl_kv_indexer_fuzz::{bridge_messages, take_prefixed};

const WORKERS: [&str; 4] = ["w-b", "w-a", "W-c", ""];

/// A hash from a small space, so that chains, overlaps and collisions are common, with the
/// extremes of i64 now and then.
fn hash(b: u8) -> i64 {
    match b {
        250 => i64::MIN,
        251 => i64::MAX,
        252 => -1,
        b => i64::from(b % 24),
    }
}

fn hashes(bytes: &[u8]) -> Vec<i64> {
    bytes.iter().copied().map(hash).collect()
}

#[derive(Debug, Arbitrary)]
struct Spec {
    version: u8,
    components: u8,
    window: u8,
    masks: [u8; 3],
}

#[derive(Debug, Arbitrary)]
struct ActionOp {
    kind: u8,
    tier: u8,
    hashes: Vec<u8>,
    masks: Option<Vec<u8>>,
    sizes: Option<Vec<u8>>,
    parent: Option<u8>,
}

#[derive(Debug, Arbitrary)]
enum Op {
    Apply {
        worker: u8,
        address: u8,
        spec: Option<Spec>,
        actions: Vec<ActionOp>,
    },
    Prefix {
        hashes: Vec<u8>,
        max_blocks: u8,
    },
    MatchKv {
        hashes: Vec<u8>,
        count_as_hit: bool,
    },
    HitCounts(Vec<u8>),
    /// A prefix query over a window of the seed batch's hashes.
    SeedPrefix {
        start: u8,
        len: u8,
        max_blocks: u8,
    },
    /// Raw bytes decoded as an apply request, as the server would decode a hostile body.
    RawApply(Vec<u8>),
}

/// Wire values around the defined ones (0 and 4 are invalid, -1 too).
fn wire_enum(b: u8) -> i32 {
    i32::from(b % 6) - 1
}

fn apply_message(
    worker: u8,
    address: u8,
    spec: Option<Spec>,
    actions: Vec<ActionOp>,
) -> pb::ApplyExternalKvBatchRequest {
    pb::ApplyExternalKvBatchRequest {
        worker_id: WORKERS[usize::from(worker) % WORKERS.len()].into(),
        seq: u64::from(worker),
        bridge_incarnation: None,
        bridge_batch: None,
        worker_address: match address % 3 {
            0 => String::new(),
            n => format!("http://worker-{n}:30000"),
        },
        cache_spec: spec.map(|spec| pb::WorkerCacheSpec {
            version: u32::from(spec.version % 3),
            components: u32::from(spec.components % 8),
            swa_window_tokens: u32::from(spec.window % 8) * 16,
            full_tier_mask: u32::from(spec.masks[0] % 16),
            swa_tier_mask: u32::from(spec.masks[1] % 16),
            mamba_tier_mask: u32::from(spec.masks[2] % 16),
        }),
        actions: actions
            .into_iter()
            .map(|action| pb::ExternalKvAction {
                r#type: wire_enum(action.kind),
                tier: wire_enum(action.tier),
                hashes: hashes(&action.hashes),
                component_masks: action
                    .masks
                    .map(|masks| masks.iter().map(|m| u32::from(m % 8)).collect())
                    .unwrap_or_default(),
                block_sizes: action
                    .sizes
                    .map(|sizes| sizes.iter().map(|s| u32::from(*s)).collect())
                    .unwrap_or_default(),
                parent_block_hash: action.parent.map(hash),
            })
            .collect(),
    }
}

/// What travels: the message encoded and decoded again.
fn round_trip<M: Message + Default>(message: &M) -> M {
    M::decode(message.encode_to_vec().as_slice()).expect("a message prost encoded decodes")
}

struct Pair {
    index: Index,
    model: Model,
}

impl Pair {
    fn apply(&mut self, message: pb::ApplyExternalKvBatchRequest) {
        let request = convert::apply_request(message);
        let expected = self.model.apply(&request);
        let real = request.validate().map(|valid| self.index.apply(&valid));
        assert_eq!(real, expected, "apply");
    }

    fn prefix(&self, message: pb::MatchExternalKvPrefixRequest) {
        let message = round_trip(&message);
        same_answer(
            "match_prefix",
            self.index.match_prefix(&message.hashes, message.max_blocks),
            self.model.match_prefix(&message.hashes, message.max_blocks),
            convert::prefix_response,
        );
    }

    fn match_kv(&mut self, message: pb::MatchExternalKvRequest) {
        let message = round_trip(&message);
        let answered = same_answer(
            "match_kv",
            self.index.match_kv(&message.hashes),
            self.model.match_kv(&message.hashes),
            convert::match_response,
        );
        if answered && message.count_as_hit {
            self.index.count_hits(&message.hashes);
            self.model.count_hits(&message.hashes);
        }
    }

    fn hit_counts(&self, message: pb::GetExternalKvHitCountsRequest) {
        let message = round_trip(&message);
        same_answer(
            "hit_counts",
            self.index.hit_counts(&message.hashes),
            self.model.hit_counts(&message.hashes),
            convert::hit_counts_response,
        );
    }
}

/// Asserts that the index answered `what` as the model did; an answer must then travel as its
/// response message. Whether there was an answer (not an error).
fn same_answer<T, E, R>(
    what: &str,
    real: Result<T, E>,
    expected: Result<T, E>,
    response: impl FnOnce(T) -> R,
) -> bool
where
    T: PartialEq + std::fmt::Debug,
    E: PartialEq + std::fmt::Debug,
    R: Message + Default,
{
    assert_eq!(real, expected, "{what}");
    let answered = real.is_ok();
    if let Ok(answer) = real {
        round_trip(&response(answer));
    }
    answered
}

fuzz_target!(|data: &[u8]| {
    let (payload, rest) = take_prefixed(data);
    let Ok(ops) = Vec::<Op>::arbitrary_take_rest(Unstructured::new(rest)) else {
        return;
    };
    let mut pair = Pair {
        index: Index::new(),
        model: Model::new(),
    };
    let mut seed_hashes = Vec::new();
    for worker in ["w-a", "w-b"] {
        for message in bridge_messages(payload, worker).unwrap_or_default() {
            for action in &message.actions {
                seed_hashes.extend_from_slice(&action.hashes);
            }
            pair.apply(round_trip(&message));
        }
    }
    for op in ops {
        match op {
            Op::Apply {
                worker,
                address,
                spec,
                actions,
            } => pair.apply(round_trip(&apply_message(worker, address, spec, actions))),
            Op::RawApply(bytes) => {
                if let Ok(message) = pb::ApplyExternalKvBatchRequest::decode(bytes.as_slice()) {
                    pair.apply(message);
                }
            }
            Op::Prefix {
                hashes: h,
                max_blocks,
            } => pair.prefix(pb::MatchExternalKvPrefixRequest {
                hashes: hashes(&h),
                max_blocks: u32::from(max_blocks % 8),
                max_matches: None,
                include_predictions: None,
            }),
            Op::MatchKv {
                hashes: h,
                count_as_hit,
            } => pair.match_kv(pb::MatchExternalKvRequest {
                hashes: hashes(&h),
                count_as_hit,
            }),
            Op::SeedPrefix {
                start,
                len,
                max_blocks,
            } => {
                let start = usize::from(start).min(seed_hashes.len());
                let end = (start + usize::from(len) + 1).min(seed_hashes.len());
                if start < end {
                    pair.prefix(pb::MatchExternalKvPrefixRequest {
                        hashes: seed_hashes[start..end].to_vec(),
                        max_blocks: u32::from(max_blocks % 8),
                        max_matches: None,
                        include_predictions: None,
                    });
                }
            }
            Op::HitCounts(h) => {
                pair.hit_counts(pb::GetExternalKvHitCountsRequest { hashes: hashes(&h) })
            }
        }
        assert_eq!(pair.index.stats(), pair.model.stats(), "stats");
        pair.index.check_invariants();
    }
});
