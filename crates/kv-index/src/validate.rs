//! Request validation: every rule of the contract's validation table, checked before any state
//! changes, reported as a typed error that the server maps to a status code.

use crate::types::{
    Action, ActionKind, ApplyRequest, MAX_ACTIONS_PER_APPLY, MAX_HASHES_PER_REQUEST, Tier,
    ValidApply,
};

/// Which status class an error belongs to; the server maps each to one gRPC code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// INVALID_ARGUMENT
    InvalidArgument,
    /// RESOURCE_EXHAUSTED
    ResourceExhausted,
}

/// Why a request was rejected. A rejected request changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    #[error("worker_id is empty")]
    EmptyWorkerId,
    #[error("{count} actions in one apply; at most {MAX_ACTIONS_PER_APPLY} are allowed")]
    TooManyActions { count: usize },
    #[error("{count} hashes in one apply; at most {MAX_HASHES_PER_REQUEST} are allowed")]
    TooManyApplyHashes { count: usize },
    #[error("action {action}: tier {value} is not a known tier (TIER_UNKNOWN or undefined)")]
    UnknownTier { action: usize, value: i32 },
    #[error(
        "action {action}: type {value} is not a known action type (ACTION_UNKNOWN or undefined)"
    )]
    UnknownActionType { action: usize, value: i32 },
    #[error("action {action}: {kind:?} needs at least one hash")]
    EmptyAction { action: usize, kind: ActionKind },
    #[error(
        "action {action}: {field} has {len} entries for {hashes} hashes; must be empty or equal"
    )]
    MisalignedSideArray {
        action: usize,
        field: &'static str,
        len: usize,
        hashes: usize,
    },
    #[error("the request has no hashes")]
    NoHashes,
    #[error("{count} hashes in one request; at most {MAX_HASHES_PER_REQUEST} are allowed")]
    TooManyQueryHashes { count: usize },
}

impl ValidationError {
    /// The status class the contract gives this rule.
    pub fn class(&self) -> ErrorClass {
        match self {
            ValidationError::TooManyActions { .. }
            | ValidationError::TooManyApplyHashes { .. }
            | ValidationError::TooManyQueryHashes { .. } => ErrorClass::ResourceExhausted,
            _ => ErrorClass::InvalidArgument,
        }
    }
}

impl ApplyRequest {
    /// Checks every rule for `ApplyExternalKvBatch` and converts the wire enums. Rules are checked
    /// in a fixed order: worker id, size limits, then each action in order (type, tier, hashes,
    /// side arrays).
    pub fn validate(self) -> Result<ValidApply, ValidationError> {
        if self.worker_id.is_empty() {
            return Err(ValidationError::EmptyWorkerId);
        }
        if self.actions.len() > MAX_ACTIONS_PER_APPLY {
            return Err(ValidationError::TooManyActions {
                count: self.actions.len(),
            });
        }
        let hashes: usize = self.actions.iter().map(|a| a.hashes.len()).sum();
        if hashes > MAX_HASHES_PER_REQUEST {
            return Err(ValidationError::TooManyApplyHashes { count: hashes });
        }
        let mut actions = Vec::with_capacity(self.actions.len());
        for (index, action) in self.actions.into_iter().enumerate() {
            let kind = ActionKind::from_wire(action.action_type).ok_or(
                ValidationError::UnknownActionType {
                    action: index,
                    value: action.action_type,
                },
            )?;
            let tier = Tier::from_wire(action.tier).ok_or(ValidationError::UnknownTier {
                action: index,
                value: action.tier,
            })?;
            if kind != ActionKind::ClearAllAtTier && action.hashes.is_empty() {
                return Err(ValidationError::EmptyAction {
                    action: index,
                    kind,
                });
            }
            for (field, len) in [
                ("component_masks", action.component_masks.len()),
                ("block_sizes", action.block_sizes.len()),
            ] {
                if len != 0 && len != action.hashes.len() {
                    return Err(ValidationError::MisalignedSideArray {
                        action: index,
                        field,
                        len,
                        hashes: action.hashes.len(),
                    });
                }
            }
            actions.push(Action {
                kind,
                tier,
                hashes: action.hashes,
                component_masks: action.component_masks,
                block_sizes: action.block_sizes,
                parent_block_hash: action.parent_block_hash,
            });
        }
        Ok(ValidApply {
            worker_id: self.worker_id,
            worker_address: self.worker_address,
            cache_spec: self.cache_spec,
            actions,
        })
    }
}

/// Checks the hashes of `MatchExternalKv` and `GetExternalKvHitCounts`: 1 to 16,384.
pub fn validate_lookup(hashes: &[i64]) -> Result<(), ValidationError> {
    if hashes.is_empty() {
        return Err(ValidationError::NoHashes);
    }
    if hashes.len() > MAX_HASHES_PER_REQUEST {
        return Err(ValidationError::TooManyQueryHashes {
            count: hashes.len(),
        });
    }
    Ok(())
}

/// Checks the hashes of `MatchExternalKvPrefix`: at least one (no count cap beyond the message
/// size).
pub fn validate_prefix(hashes: &[i64]) -> Result<(), ValidationError> {
    if hashes.is_empty() {
        return Err(ValidationError::NoHashes);
    }
    Ok(())
}
