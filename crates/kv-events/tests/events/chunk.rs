//! Splitting actions into apply-sized groups: table cases at the limits, and properties over
//! random action lists.

use kv_events::{Action, split};
use kv_index::{ActionKind, MAX_ACTIONS_PER_APPLY, MAX_HASHES_PER_REQUEST, Tier};
use proptest::prelude::*;

const MAX_H: usize = MAX_HASHES_PER_REQUEST;

fn report(first: i64, len: usize, parent: Option<i64>, sides: bool) -> Action {
    let hashes: Vec<i64> = (first..first + len as i64).collect();
    Action {
        kind: ActionKind::Report,
        tier: Tier::Hbm,
        component_masks: if sides {
            hashes.iter().map(|h| (*h % 8) as u32).collect()
        } else {
            vec![]
        },
        block_sizes: if sides {
            hashes.iter().map(|h| (*h % 64) as u32).collect()
        } else {
            vec![]
        },
        hashes,
        parent_block_hash: parent,
    }
}

fn clear(tier: Tier) -> Action {
    Action {
        kind: ActionKind::ClearAllAtTier,
        tier,
        hashes: vec![],
        component_masks: vec![],
        block_sizes: vec![],
        parent_block_hash: None,
    }
}

/// Group shapes: (actions, hashes) per group.
fn shape(groups: &[Vec<Action>]) -> Vec<(usize, usize)> {
    groups
        .iter()
        .map(|g| (g.len(), g.iter().map(|a| a.hashes.len()).sum()))
        .collect()
}

fn check(name: &str, actions: Vec<Action>, want: &[(usize, usize)]) {
    let groups = split(actions.clone());
    assert_eq!(shape(&groups), want, "{name}");
    check_properties(&actions, &groups).unwrap_or_else(|e| panic!("{name}: {e}"));
}

#[test]
fn packs_and_cuts_at_the_limits() {
    check("no actions, no groups", vec![], &[]);
    check("one clear", vec![clear(Tier::Hbm)], &[(1, 0)]);
    check(
        "256 clears fill one group",
        vec![clear(Tier::Dram); 256],
        &[(256, 0)],
    );
    check(
        "257 clears take two",
        vec![clear(Tier::Dram); 257],
        &[(256, 0), (1, 0)],
    );
    check(
        "exactly the hash limit",
        vec![report(0, MAX_H, Some(-1), true)],
        &[(1, MAX_H)],
    );
    check(
        "one over the hash limit",
        vec![report(0, MAX_H + 1, Some(-1), true)],
        &[(1, MAX_H), (1, 1)],
    );
    check(
        "three pieces, the last shared with the next action",
        vec![
            report(0, 2 * MAX_H + 10, None, false),
            report(1 << 40, 5, None, false),
            clear(Tier::Ssd),
        ],
        &[(1, MAX_H), (1, MAX_H), (3, 15)],
    );
    check(
        "two halves that do not fit together are not cut",
        vec![
            report(0, 10_000, None, false),
            report(1 << 40, 10_000, None, false),
        ],
        &[(1, 10_000), (1, 10_000)],
    );
    check(
        "filling a group to the hash limit",
        vec![
            report(0, MAX_H - 1, None, false),
            report(1 << 40, 1, None, false),
            clear(Tier::Hbm),
        ],
        &[(3, MAX_H)],
    );
    let many: Vec<Action> = (0..300)
        .map(|i| report(i * 1000, 10, None, false))
        .collect();
    check("300 small reports", many, &[(256, 2560), (44, 440)]);
}

#[test]
fn chains_the_pieces_of_a_hinted_action() {
    let groups = split(vec![report(100, 2 * MAX_H + 1, Some(7), true)]);
    let pieces: Vec<&Action> = groups.iter().flatten().collect();
    assert_eq!(pieces.len(), 3);
    assert_eq!(pieces[0].parent_block_hash, Some(7));
    assert_eq!(pieces[1].parent_block_hash, Some(100 + MAX_H as i64 - 1));
    assert_eq!(
        pieces[2].parent_block_hash,
        Some(100 + 2 * MAX_H as i64 - 1)
    );
    let unhinted = split(vec![report(100, MAX_H + 1, None, true)]);
    assert!(
        unhinted
            .iter()
            .flatten()
            .all(|piece| piece.parent_block_hash.is_none())
    );
}

#[test]
fn slices_short_side_arrays_without_panicking() {
    let mut action = report(0, MAX_H + 5, None, true);
    action.component_masks.truncate(MAX_H + 2);
    action.block_sizes.truncate(3);
    let groups = split(vec![action]);
    let pieces: Vec<&Action> = groups.iter().flatten().collect();
    assert_eq!(pieces[0].component_masks.len(), MAX_H);
    assert_eq!(pieces[1].component_masks.len(), 2);
    assert_eq!(pieces[0].block_sizes.len(), 3);
    assert!(pieces[1].block_sizes.is_empty());
}

/// Every property `split` promises, as an error naming the first one broken.
fn check_properties(input: &[Action], groups: &[Vec<Action>]) -> Result<(), String> {
    for (i, group) in groups.iter().enumerate() {
        let hashes: usize = group.iter().map(|a| a.hashes.len()).sum();
        if group.is_empty() || group.len() > MAX_ACTIONS_PER_APPLY || hashes > MAX_H {
            return Err(format!(
                "group {i} has {} actions and {hashes} hashes",
                group.len()
            ));
        }
        // Greedy: a group closes only when the next piece would not fit.
        if let Some(next) = groups.get(i + 1)
            && group.len() < MAX_ACTIONS_PER_APPLY
            && hashes + next[0].hashes.len() <= MAX_H
        {
            return Err(format!("group {i} closed early"));
        }
    }
    let mut pieces = groups.iter().flatten();
    for (a, action) in input.iter().enumerate() {
        let count = action.hashes.len().div_ceil(MAX_H).max(1);
        let mine: Vec<&Action> = pieces.by_ref().take(count).collect();
        if mine.len() != count {
            return Err(format!("action {a}: {} pieces, want {count}", mine.len()));
        }
        let mut parent = action.parent_block_hash;
        for (p, piece) in mine.iter().enumerate() {
            if piece.kind != action.kind || piece.tier != action.tier {
                return Err(format!("action {a} piece {p}: kind or tier changed"));
            }
            if p + 1 < count && piece.hashes.len() != MAX_H {
                return Err(format!(
                    "action {a} piece {p}: {} hashes",
                    piece.hashes.len()
                ));
            }
            for (side, name, full) in [
                (
                    &piece.component_masks,
                    "component_masks",
                    &action.component_masks,
                ),
                (&piece.block_sizes, "block_sizes", &action.block_sizes),
            ] {
                let want = if full.is_empty() {
                    0
                } else {
                    piece.hashes.len()
                };
                if side.len() != want {
                    return Err(format!("action {a} piece {p}: {name} not aligned"));
                }
            }
            if piece.parent_block_hash != parent {
                return Err(format!(
                    "action {a} piece {p}: hint {:?}, want {parent:?}",
                    piece.parent_block_hash
                ));
            }
            parent = parent.and(piece.hashes.last().copied());
        }
        // Each of the three arrays, widened to i64, concatenates back to the action's.
        let arrays: [fn(&Action) -> Vec<i64>; 3] = [
            |p| p.hashes.clone(),
            |p| p.component_masks.iter().map(|m| i64::from(*m)).collect(),
            |p| p.block_sizes.iter().map(|s| i64::from(*s)).collect(),
        ];
        if arrays
            .iter()
            .any(|f| mine.iter().flat_map(|p| f(p)).collect::<Vec<i64>>() != f(action))
        {
            return Err(format!("action {a}: pieces do not concatenate back"));
        }
    }
    if pieces.next().is_some() {
        return Err("more pieces than the input makes".into());
    }
    Ok(())
}

fn action_strategy() -> impl Strategy<Value = Action> {
    let len = prop_oneof![
        6 => 0usize..50,
        3 => 50usize..6_000,
        1 => 6_000usize..40_000,
    ];
    (
        0u8..3,
        0usize..3,
        len,
        any::<bool>(),
        proptest::option::of(any::<i64>()),
        any::<i64>(),
    )
        .prop_map(|(kind, tier, len, sides, parent, first)| {
            let kind = [
                ActionKind::Report,
                ActionKind::Revoke,
                ActionKind::ClearAllAtTier,
            ][kind as usize];
            let len = if kind == ActionKind::ClearAllAtTier {
                0
            } else {
                len
            };
            let hashes: Vec<i64> = (0..len as i64).map(|i| first.wrapping_add(i)).collect();
            let sides = sides && kind == ActionKind::Report;
            Action {
                kind,
                tier: Tier::ALL[tier],
                component_masks: if sides {
                    hashes.iter().map(|h| (*h as u32) & 7).collect()
                } else {
                    vec![]
                },
                block_sizes: if sides {
                    hashes.iter().map(|h| (*h >> 8) as u32).collect()
                } else {
                    vec![]
                },
                hashes,
                parent_block_hash: if kind == ActionKind::Report {
                    parent
                } else {
                    None
                },
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn split_keeps_limits_order_alignment_and_chains(
        actions in prop_oneof![
            3 => proptest::collection::vec(action_strategy(), 0..12),
            1 => proptest::collection::vec(
                (0usize..3).prop_map(|t| clear(Tier::ALL[t])), 200..600),
        ]
    ) {
        let groups = split(actions.clone());
        prop_assert_eq!(groups.is_empty(), actions.is_empty());
        if let Err(error) = check_properties(&actions, &groups) {
            return Err(TestCaseError::fail(error));
        }
    }
}
