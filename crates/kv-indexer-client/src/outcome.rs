//! What a query to the Indexer can come to, and the one place that turns wire answers and
//! status codes into it (router-contract.md, "Outcomes").

use kv_indexer_proto::v1 as pb;
use serde::Serialize;
use tonic::{Code, Status};

/// The answer to a longest-prefix query, as the router acts on it.
///
/// Every variant but `Matched`, `NoMatch` and `Rejected` means "route by load": losing the
/// Indexer costs cache affinity, never availability. `Rejected` means the two sides disagree on
/// the contract.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefixOutcome {
    /// At least one worker holds a prefix of the prompt.
    Matched {
        /// Longest first, ties in the server's stable order.
        matches: Vec<PrefixMatch>,
        /// The longest prefix, in blocks.
        best_prefix_blocks: u32,
        /// The full request's block count, also when only a leading part was sent, so that
        /// `matched_prefix_blocks / query_blocks` is a lower bound, never an overstatement.
        query_blocks: usize,
        /// Blocks the server examined (observability).
        blocks_read: u32,
    },
    /// The query was answered and no worker holds its first block (or it had no blocks).
    NoMatch,
    /// No replica could be reached (UNAVAILABLE, or the connection failed).
    Unreachable,
    /// The deadline passed (DEADLINE_EXCEEDED, CANCELLED, or the local bound fired).
    Timeout,
    /// An admission bound was full: the server's (RESOURCE_EXHAUSTED) or this client's.
    Overloaded,
    /// The message was over the server's limit (OUT_OF_RANGE).
    TooLarge,
    /// Any other status: a bug or a contract mismatch.
    Rejected { code: Code, message: String },
}

impl PrefixOutcome {
    /// A short stable name, for logs and metrics labels.
    pub fn label(&self) -> &'static str {
        match self {
            PrefixOutcome::Matched { .. } => "matched",
            PrefixOutcome::NoMatch => "no_match",
            PrefixOutcome::Unreachable => "unreachable",
            PrefixOutcome::Timeout => "timeout",
            PrefixOutcome::Overloaded => "overloaded",
            PrefixOutcome::TooLarge => "too_large",
            PrefixOutcome::Rejected { .. } => "rejected",
        }
    }

    /// Whether the next replica may answer where this one did not.
    pub(crate) fn fails_over(&self) -> bool {
        matches!(
            self,
            PrefixOutcome::Unreachable | PrefixOutcome::Timeout | PrefixOutcome::Overloaded
        )
    }

    /// The outcome of a failed call, by its status code.
    pub fn from_status(status: &Status) -> PrefixOutcome {
        match status.code() {
            Code::Unavailable => PrefixOutcome::Unreachable,
            Code::DeadlineExceeded | Code::Cancelled => PrefixOutcome::Timeout,
            Code::ResourceExhausted => PrefixOutcome::Overloaded,
            Code::OutOfRange => PrefixOutcome::TooLarge,
            code => PrefixOutcome::Rejected {
                code,
                message: status.message().to_string(),
            },
        }
    }

    /// The outcome of an answered query of `query_blocks` blocks, of which `sent` were sent.
    pub(crate) fn from_response(
        response: pb::MatchExternalKvPrefixResponse,
        query_blocks: usize,
        sent: usize,
    ) -> PrefixOutcome {
        // The server cannot match more blocks than it was given; a claim beyond that would
        // overstate the cache, so it is capped.
        let cap = u32::try_from(sent).unwrap_or(u32::MAX);
        let matches = prefix_matches(response.matches, sent);
        if matches.is_empty() {
            return PrefixOutcome::NoMatch;
        }
        PrefixOutcome::Matched {
            best_prefix_blocks: response.best_prefix_blocks.min(cap),
            matches,
            query_blocks,
            blocks_read: response.blocks_read,
        }
    }
}

/// The wire's matches, each capped at the `sent` blocks (a server cannot match more).
pub(crate) fn prefix_matches(
    matches: Vec<pb::ExternalKvPrefixMatch>,
    sent: usize,
) -> Vec<PrefixMatch> {
    let cap = u32::try_from(sent).unwrap_or(u32::MAX);
    matches
        .into_iter()
        .map(|m| PrefixMatch {
            worker_address: m.worker_address,
            worker_id: m.worker_id,
            matched_prefix_blocks: m.matched_prefix_blocks.min(cap),
        })
        .collect()
}

/// One worker holding a prefix of the prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PrefixMatch {
    /// The router's routing identity; compare it with worker URLs byte for byte.
    pub worker_address: String,
    /// For logs.
    pub worker_id: String,
    pub matched_prefix_blocks: u32,
}

/// A cache tier as the wire names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Tier {
    Hbm,
    Dram,
    Ssd,
    /// A value this client does not know (a newer server).
    Unknown(i32),
}

impl Tier {
    fn from_wire(value: i32) -> Tier {
        match pb::TierType::try_from(value) {
            Ok(pb::TierType::TierHbm) => Tier::Hbm,
            Ok(pb::TierType::TierDram) => Tier::Dram,
            Ok(pb::TierType::TierSsd) => Tier::Ssd,
            _ => Tier::Unknown(value),
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tier::Hbm => f.write_str("HBM"),
            Tier::Dram => f.write_str("DRAM"),
            Tier::Ssd => f.write_str("SSD"),
            Tier::Unknown(value) => write!(f, "TIER({value})"),
        }
    }
}

/// One worker's placements of the asked hashes (`MatchExternalKv`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeMatch {
    pub worker_id: String,
    pub address: String,
    /// Ordered by tier.
    pub tiers: Vec<TierPlacements>,
}

/// The hashes one worker holds at one tier, with their masks and token counts (each either
/// empty or aligned with `hashes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TierPlacements {
    pub tier: Tier,
    pub hashes: Vec<i64>,
    pub component_masks: Vec<u32>,
    pub block_sizes: Vec<u32>,
}

/// A block's cumulative hit count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HitCount {
    pub hash: i64,
    pub hit_count_total: u64,
}

pub(crate) fn node_matches(response: pb::MatchExternalKvResponse) -> Vec<NodeMatch> {
    response
        .matches
        .into_iter()
        .map(|m| NodeMatch {
            worker_id: m.worker_id,
            address: m.address,
            tiers: m
                .hashes_by_tier
                .into_iter()
                .map(|t| TierPlacements {
                    tier: Tier::from_wire(t.tier),
                    hashes: t.hashes,
                    component_masks: t.component_masks,
                    block_sizes: t.block_sizes,
                })
                .collect(),
        })
        .collect()
}

pub(crate) fn hit_counts(response: pb::GetExternalKvHitCountsResponse) -> Vec<HitCount> {
    response
        .entries
        .into_iter()
        .map(|e| HitCount {
            hash: e.hash,
            hit_count_total: e.hit_count_total,
        })
        .collect()
}

/// A failed lookup (`match_exact`, `hit_counts`): the server's status, or the local failure
/// under the code a server would have used (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct QueryError {
    pub code: Code,
    pub message: String,
}

impl From<Status> for QueryError {
    fn from(status: Status) -> QueryError {
        QueryError {
            code: status.code(),
            message: status.message().to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(code: Code, expect: PrefixOutcome) {
        let status = Status::new(code, "why");
        assert_eq!(PrefixOutcome::from_status(&status), expect, "{code:?}");
    }

    #[test]
    fn classifies_status_codes_as_the_router_contract_says() {
        check(Code::Unavailable, PrefixOutcome::Unreachable);
        check(Code::DeadlineExceeded, PrefixOutcome::Timeout);
        check(Code::Cancelled, PrefixOutcome::Timeout);
        check(Code::ResourceExhausted, PrefixOutcome::Overloaded);
        check(Code::OutOfRange, PrefixOutcome::TooLarge);
        for code in [
            Code::Unknown,
            Code::InvalidArgument,
            Code::NotFound,
            Code::FailedPrecondition,
            Code::Unimplemented,
            Code::Internal,
            Code::Unauthenticated,
            Code::PermissionDenied,
        ] {
            check(
                code,
                PrefixOutcome::Rejected {
                    code,
                    message: "why".into(),
                },
            );
        }
    }

    #[test]
    fn fails_over_only_on_transient_outcomes() {
        let fails_over: Vec<&str> = [
            PrefixOutcome::NoMatch,
            PrefixOutcome::Unreachable,
            PrefixOutcome::Timeout,
            PrefixOutcome::Overloaded,
            PrefixOutcome::TooLarge,
            PrefixOutcome::Rejected {
                code: Code::Internal,
                message: String::new(),
            },
        ]
        .iter()
        .filter(|o| o.fails_over())
        .map(PrefixOutcome::label)
        .collect();
        assert_eq!(fails_over, ["unreachable", "timeout", "overloaded"]);
    }

    #[test]
    fn an_empty_match_list_is_no_match() {
        let response = pb::MatchExternalKvPrefixResponse {
            matches: vec![],
            best_prefix_blocks: 0,
            blocks_read: 1,
            predicted: vec![],
        };
        assert_eq!(
            PrefixOutcome::from_response(response, 10, 10),
            PrefixOutcome::NoMatch
        );
    }

    #[test]
    fn never_claims_more_blocks_than_were_sent() {
        let response = pb::MatchExternalKvPrefixResponse {
            matches: vec![pb::ExternalKvPrefixMatch {
                worker_address: "http://a".into(),
                matched_prefix_blocks: 9,
                worker_id: "a".into(),
            }],
            best_prefix_blocks: 9,
            blocks_read: 9,
            predicted: vec![],
        };
        let PrefixOutcome::Matched {
            matches,
            best_prefix_blocks,
            query_blocks,
            ..
        } = PrefixOutcome::from_response(response, 100, 4)
        else {
            panic!("expected a match");
        };
        assert_eq!(best_prefix_blocks, 4);
        assert_eq!(matches[0].matched_prefix_blocks, 4);
        assert_eq!(query_blocks, 100);
    }
}
