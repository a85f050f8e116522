//! Actions into groups that each fit one `ApplyExternalKvBatch`: at most
//! [`MAX_ACTIONS_PER_APPLY`] actions and [`MAX_HASHES_PER_REQUEST`] hashes.

use std::ops::Range;

use kv_index::{MAX_ACTIONS_PER_APPLY, MAX_HASHES_PER_REQUEST};

use crate::mapping::Action;

/// Cuts every action over [`MAX_HASHES_PER_REQUEST`] hashes into pieces of that many (side arrays
/// sliced alongside; a later piece of a hinted chain hangs off the previous piece's last hash),
/// then packs the actions greedily, in order, into groups. A CLEAR counts as an action with no
/// hashes. No actions, no groups.
///
/// Side arrays are expected empty or aligned with the hashes, as [`crate::map_events`] makes
/// them; a shorter one is sliced as far as it goes rather than panicking.
pub fn split(actions: Vec<Action>) -> Vec<Vec<Action>> {
    let mut groups = Vec::new();
    let mut group: Vec<Action> = Vec::new();
    let mut group_hashes = 0;
    for action in actions {
        for piece in pieces(action) {
            if !group.is_empty()
                && (group.len() == MAX_ACTIONS_PER_APPLY
                    || group_hashes + piece.hashes.len() > MAX_HASHES_PER_REQUEST)
            {
                groups.push(std::mem::take(&mut group));
                group_hashes = 0;
            }
            group_hashes += piece.hashes.len();
            group.push(piece);
        }
    }
    if !group.is_empty() {
        groups.push(group);
    }
    groups
}

fn pieces(action: Action) -> Vec<Action> {
    if action.hashes.len() <= MAX_HASHES_PER_REQUEST {
        return vec![action];
    }
    let mut pieces = Vec::with_capacity(action.hashes.len().div_ceil(MAX_HASHES_PER_REQUEST));
    let mut parent_block_hash = action.parent_block_hash;
    for start in (0..action.hashes.len()).step_by(MAX_HASHES_PER_REQUEST) {
        let range = start..(start + MAX_HASHES_PER_REQUEST).min(action.hashes.len());
        let hashes = action.hashes[range.clone()].to_vec();
        let next_parent = parent_block_hash.and(hashes.last().copied());
        pieces.push(Action {
            kind: action.kind,
            tier: action.tier,
            component_masks: slice(&action.component_masks, range.clone()),
            block_sizes: slice(&action.block_sizes, range),
            hashes,
            parent_block_hash,
        });
        parent_block_hash = next_parent;
    }
    pieces
}

fn slice<T: Copy>(values: &[T], range: Range<usize>) -> Vec<T> {
    let end = range.end.min(values.len());
    values.get(range.start..end).unwrap_or_default().to_vec()
}
