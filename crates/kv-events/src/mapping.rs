//! Events to index actions, as the bridge contract says: `BlockStored` → REPORT, `BlockRemoved`
//! → REVOKE, consecutive events of one kind and tier merged into one action; `AllBlocksCleared`
//! → one CLEAR_ALL_AT_TIER per clear tier, a barrier to merging.

use kv_index::{ActionKind, Tier};

use crate::decode::{BlockStored, Event};

/// One action of an `ApplyExternalKvBatch`, before splitting: the index's own action type, so
/// the bridge sends exactly what the index applies.
pub use kv_index::Action;

/// CLEAR_ALL_AT_TIER for `tier`.
pub fn clear_action(tier: Tier) -> Action {
    Action {
        kind: ActionKind::ClearAllAtTier,
        tier,
        hashes: Vec::new(),
        component_masks: Vec::new(),
        block_sizes: Vec::new(),
        parent_block_hash: None,
    }
}

/// Maps one batch's events, in order.
///
/// A clear tier listed twice is cleared once. Events without hashes carry nothing to apply (the
/// index rejects empty actions), so they are passed over as if absent.
pub fn map_events(events: &[Event], clear_tiers: &[Tier]) -> Vec<Action> {
    let mut actions = Vec::new();
    let mut open: Option<Open> = None;
    for event in events {
        match event {
            Event::BlockStored(store) if store.block_hashes.is_empty() => {}
            Event::BlockRemoved { block_hashes, .. } if block_hashes.is_empty() => {}
            Event::BlockStored(store) => match &mut open {
                Some(action) if action.accepts(ActionKind::Report, store.tier) => {
                    action.push_store(store);
                }
                _ => {
                    actions.extend(open.take().map(Open::finish));
                    open = Some(Open::store(store));
                }
            },
            Event::BlockRemoved { block_hashes, tier } => match &mut open {
                Some(action) if action.accepts(ActionKind::Revoke, *tier) => {
                    action.hashes.extend_from_slice(block_hashes);
                }
                _ => {
                    actions.extend(open.take().map(Open::finish));
                    open = Some(Open::remove(block_hashes, *tier));
                }
            },
            Event::AllBlocksCleared => {
                actions.extend(open.take().map(Open::finish));
                for (i, tier) in clear_tiers.iter().enumerate() {
                    if !clear_tiers[..i].contains(tier) {
                        actions.push(clear_action(*tier));
                    }
                }
            }
        }
    }
    actions.extend(open.map(Open::finish));
    actions
}

/// The action being merged into.
struct Open {
    kind: ActionKind,
    tier: Tier,
    hashes: Vec<i64>,
    /// One entry per merged store, expanded into the side arrays only if some store has a mask.
    stores: Vec<StoreSpan>,
    /// The first store's parent, while every merged store continued the chain.
    chain_parent: Option<i64>,
}

struct StoreSpan {
    len: usize,
    component_mask: Option<u32>,
    block_size: u32,
}

impl Open {
    fn store(store: &BlockStored) -> Open {
        Open {
            kind: ActionKind::Report,
            tier: store.tier,
            hashes: store.block_hashes.clone(),
            stores: vec![StoreSpan::of(store)],
            chain_parent: store.parent_block_hash,
        }
    }

    fn remove(hashes: &[i64], tier: Tier) -> Open {
        Open {
            kind: ActionKind::Revoke,
            tier,
            hashes: hashes.to_vec(),
            stores: Vec::new(),
            chain_parent: None,
        }
    }

    fn accepts(&self, kind: ActionKind, tier: Tier) -> bool {
        self.kind == kind && self.tier == tier
    }

    fn push_store(&mut self, store: &BlockStored) {
        if store.parent_block_hash != self.hashes.last().copied() {
            self.chain_parent = None;
        }
        self.hashes.extend_from_slice(&store.block_hashes);
        self.stores.push(StoreSpan::of(store));
    }

    fn finish(self) -> Action {
        let mut component_masks = Vec::new();
        let mut block_sizes = Vec::new();
        if self.stores.iter().any(|span| span.component_mask.is_some()) {
            component_masks.reserve_exact(self.hashes.len());
            block_sizes.reserve_exact(self.hashes.len());
            for span in &self.stores {
                let mask = span.component_mask.unwrap_or(0);
                component_masks.extend(std::iter::repeat_n(mask, span.len));
                block_sizes.extend(std::iter::repeat_n(span.block_size, span.len));
            }
        }
        Action {
            kind: self.kind,
            tier: self.tier,
            hashes: self.hashes,
            component_masks,
            block_sizes,
            parent_block_hash: self.chain_parent,
        }
    }
}

impl StoreSpan {
    fn of(store: &BlockStored) -> StoreSpan {
        StoreSpan {
            len: store.block_hashes.len(),
            component_mask: store.component_mask,
            block_size: store.block_size,
        }
    }
}
