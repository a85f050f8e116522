//! The bridge contract's mapping rules, one table row each.

use crate::common::plain_stored;
use kv_events::{Action, Event, map_events};
use kv_index::{ActionKind, Tier};

const ALL: &[Tier] = &[Tier::Hbm, Tier::Dram, Tier::Ssd];

fn store(hashes: &[i64], parent: Option<i64>, tier: Tier) -> Event {
    plain_stored(hashes, parent, tier, 16, hashes.len() * 16)
}

/// A store with component data and its own block size.
fn store_c(hashes: &[i64], parent: Option<i64>, mask: u32, block_size: u32) -> Event {
    let Event::BlockStored(mut stored) = store(hashes, parent, Tier::Hbm) else {
        unreachable!()
    };
    stored.component_mask = Some(mask);
    stored.block_size = block_size;
    Event::BlockStored(stored)
}

fn remove(hashes: &[i64], tier: Tier) -> Event {
    Event::BlockRemoved {
        block_hashes: hashes.to_vec(),
        tier,
    }
}

fn action(kind: ActionKind, tier: Tier, hashes: &[i64], parent: Option<i64>) -> Action {
    Action {
        kind,
        tier,
        hashes: hashes.to_vec(),
        component_masks: Vec::new(),
        block_sizes: Vec::new(),
        parent_block_hash: parent,
    }
}

fn report(tier: Tier, hashes: &[i64], parent: Option<i64>) -> Action {
    action(ActionKind::Report, tier, hashes, parent)
}

fn revoke(tier: Tier, hashes: &[i64]) -> Action {
    action(ActionKind::Revoke, tier, hashes, None)
}

fn clear(tier: Tier) -> Action {
    action(ActionKind::ClearAllAtTier, tier, &[], None)
}

fn with_sides(mut action: Action, masks: &[u32], sizes: &[u32]) -> Action {
    action.component_masks = masks.to_vec();
    action.block_sizes = sizes.to_vec();
    action
}

fn check(name: &str, events: Vec<Event>, clear_tiers: &[Tier], want: Vec<Action>) {
    assert_eq!(map_events(&events, clear_tiers), want, "{name}");
}

#[test]
fn merges_consecutive_events_of_one_kind_and_tier() {
    use Tier::*;
    check("no events", vec![], ALL, vec![]);
    // One store alone: "a root store has no hint" below.
    check(
        "stores to one tier merge",
        vec![
            store(&[1, 2], None, Hbm),
            store(&[7], None, Hbm),
            store(&[8, 9], None, Hbm),
        ],
        ALL,
        vec![report(Hbm, &[1, 2, 7, 8, 9], None)],
    );
    check(
        "removes from one tier merge",
        vec![remove(&[1], Dram), remove(&[2, 3], Dram)],
        ALL,
        vec![revoke(Dram, &[1, 2, 3])],
    );
    check(
        "a tier change starts a new action",
        vec![
            store(&[1], None, Hbm),
            store(&[2], None, Dram),
            store(&[3], None, Hbm),
        ],
        ALL,
        vec![
            report(Hbm, &[1], None),
            report(Dram, &[2], None),
            report(Hbm, &[3], None),
        ],
    );
    check(
        "a remove between stores starts new actions",
        vec![
            store(&[1], None, Hbm),
            remove(&[1], Hbm),
            store(&[2], None, Hbm),
        ],
        ALL,
        vec![
            report(Hbm, &[1], None),
            revoke(Hbm, &[1]),
            report(Hbm, &[2], None),
        ],
    );
    check(
        "removes from two tiers",
        vec![remove(&[1], Hbm), remove(&[1], Ssd), remove(&[2], Ssd)],
        ALL,
        vec![revoke(Hbm, &[1]), revoke(Ssd, &[1, 2])],
    );
    check(
        "repeated hashes are kept as sent",
        vec![store(&[1], None, Hbm), store(&[1], None, Hbm)],
        ALL,
        vec![report(Hbm, &[1, 1], None)],
    );
    check(
        "events without hashes are passed over",
        vec![
            store(&[1], Some(0), Hbm),
            store(&[], Some(1), Hbm),
            remove(&[], Hbm),
            store(&[2], Some(1), Hbm),
        ],
        ALL,
        vec![report(Hbm, &[1, 2], Some(0))],
    );
    check(
        "only empty events",
        vec![store(&[], None, Hbm), remove(&[], Dram)],
        ALL,
        vec![],
    );
}

#[test]
fn clears_each_clear_tier_as_a_barrier() {
    use Tier::*;
    check(
        "clear alone",
        vec![Event::AllBlocksCleared],
        ALL,
        vec![clear(Hbm), clear(Dram), clear(Ssd)],
    );
    check(
        "clear between stores",
        vec![
            store(&[1], None, Hbm),
            Event::AllBlocksCleared,
            store(&[2], Some(1), Hbm),
        ],
        &[Hbm],
        vec![
            report(Hbm, &[1], None),
            clear(Hbm),
            report(Hbm, &[2], Some(1)),
        ],
    );
    check(
        "clear between removes",
        vec![
            remove(&[1], Dram),
            Event::AllBlocksCleared,
            remove(&[2], Dram),
        ],
        &[Dram, Hbm],
        vec![
            revoke(Dram, &[1]),
            clear(Dram),
            clear(Hbm),
            revoke(Dram, &[2]),
        ],
    );
    check(
        "no clear tiers: no clear action, still a barrier",
        vec![
            store(&[1], None, Hbm),
            Event::AllBlocksCleared,
            store(&[2], None, Hbm),
        ],
        &[],
        vec![report(Hbm, &[1], None), report(Hbm, &[2], None)],
    );
    check(
        "a tier listed twice is cleared once",
        vec![Event::AllBlocksCleared],
        &[Ssd, Hbm, Ssd],
        vec![clear(Ssd), clear(Hbm)],
    );
    check(
        "two clears in a row",
        vec![Event::AllBlocksCleared, Event::AllBlocksCleared],
        &[Hbm],
        vec![clear(Hbm), clear(Hbm)],
    );
}

#[test]
fn fills_side_arrays_only_with_component_data() {
    use Tier::*;
    check(
        "legacy stores: no side arrays",
        vec![store(&[1], None, Hbm), store(&[2], None, Hbm)],
        ALL,
        vec![report(Hbm, &[1, 2], None)],
    );
    check(
        "one store with a mask",
        vec![store_c(&[1, 2], None, 3, 16)],
        ALL,
        vec![with_sides(report(Hbm, &[1, 2], None), &[3, 3], &[16, 16])],
    );
    check(
        "legacy hashes beside component data get mask 0",
        vec![
            store(&[1, 2], None, Hbm),
            store_c(&[3], Some(2), 5, 32),
            store(&[4], Some(3), Hbm),
        ],
        ALL,
        vec![with_sides(
            report(Hbm, &[1, 2, 3, 4], None),
            &[0, 0, 5, 0],
            &[16, 16, 32, 16],
        )],
    );
    check(
        "an empty component_types list is component data",
        vec![store(&[1], None, Hbm), store_c(&[2], None, 0, 16)],
        ALL,
        vec![with_sides(report(Hbm, &[1, 2], None), &[0, 0], &[16, 16])],
    );
    check(
        "side arrays are per action",
        vec![
            store_c(&[1], None, 1, 16),
            remove(&[1], Hbm),
            store(&[2], None, Hbm),
        ],
        ALL,
        vec![
            with_sides(report(Hbm, &[1], None), &[1], &[16]),
            revoke(Hbm, &[1]),
            report(Hbm, &[2], None),
        ],
    );
}

#[test]
fn sets_the_chain_hint_only_for_one_whole_chain() {
    use Tier::*;
    check(
        "a root store has no hint",
        vec![store(&[1, 2], None, Hbm)],
        ALL,
        vec![report(Hbm, &[1, 2], None)],
    );
    check(
        "a store off a parent",
        vec![store(&[1, 2], Some(9), Hbm)],
        ALL,
        vec![report(Hbm, &[1, 2], Some(9))],
    );
    check(
        "merged stores continuing the chain",
        vec![
            store(&[1, 2], Some(9), Hbm),
            store(&[3], Some(2), Hbm),
            store(&[4, 5], Some(3), Hbm),
        ],
        ALL,
        vec![report(Hbm, &[1, 2, 3, 4, 5], Some(9))],
    );
    check(
        "a later store off another parent",
        vec![store(&[1, 2], Some(9), Hbm), store(&[3], Some(1), Hbm)],
        ALL,
        vec![report(Hbm, &[1, 2, 3], None)],
    );
    check(
        "a later root store",
        vec![store(&[1, 2], Some(9), Hbm), store(&[3], None, Hbm)],
        ALL,
        vec![report(Hbm, &[1, 2, 3], None)],
    );
    check(
        "a chain from a root store",
        vec![store(&[1, 2], None, Hbm), store(&[3], Some(2), Hbm)],
        ALL,
        vec![report(Hbm, &[1, 2, 3], None)],
    );
    check(
        "a break then a continuation stays broken",
        vec![
            store(&[1], Some(9), Hbm),
            store(&[2], Some(7), Hbm),
            store(&[3], Some(2), Hbm),
        ],
        ALL,
        vec![report(Hbm, &[1, 2, 3], None)],
    );
    check(
        "each action has its own hint",
        vec![store(&[1], Some(9), Hbm), store(&[2], Some(1), Dram)],
        ALL,
        vec![report(Hbm, &[1], Some(9)), report(Dram, &[2], Some(1))],
    );
    check(
        "removes have no hint",
        vec![remove(&[1, 2], Hbm)],
        ALL,
        vec![revoke(Hbm, &[1, 2])],
    );
}
