//! The wire request builder both the contract rules and the model test write their actions with.

use kv_index::ActionRequest;

/// An action with no chain hint.
pub fn action(
    action_type: i32,
    tier: i32,
    hashes: &[i64],
    masks: &[u32],
    sizes: &[u32],
) -> ActionRequest {
    ActionRequest {
        action_type,
        tier,
        hashes: hashes.to_vec(),
        component_masks: masks.to_vec(),
        block_sizes: sizes.to_vec(),
        parent_block_hash: None,
    }
}
