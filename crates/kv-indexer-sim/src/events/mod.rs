//! KV events as SGLang publishes them: `BlockStored` (a coalesced chain of pages),
//! `BlockRemoved` and `AllBlocksCleared`, and the [`Journal`] that turns page-by-page cache
//! changes into them.
//!
//! The msgpack encoding of a batch is in [`encode`].

pub mod encode;

pub use encode::{Encoder, Encoding};

/// Where a page lives, named as SGLang's `medium` field names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Medium {
    /// Device memory: `"GPU"`.
    Gpu,
    /// The host tier of a hierarchical cache: `"CPU_PINNED"`.
    CpuPinned,
}

impl Medium {
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::CpuPinned => "CPU_PINNED",
        }
    }

    /// vLLM's name: `"GPU"`, or `"CPU"` for its CPU offloading tier.
    pub fn vllm_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::CpuPinned => "CPU",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
}

/// A chain of newly stored pages: each hash's parent is the one before it, the first's is
/// `parent_block_hash` (nil for a page at the root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStored {
    pub block_hashes: Vec<i64>,
    pub parent_block_hash: Option<i64>,
    /// The tokens of every page of the chain, in order.
    pub token_ids: Vec<u64>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Medium,
    /// Written only when set, as SGLang omits them.
    pub cache_salt: Option<String>,
    pub session_id: Option<String>,
    pub lora_name: Option<String>,
}

impl BlockStored {
    /// A chain without the optional fields the simulator never sets.
    pub fn new(
        block_hashes: Vec<i64>,
        parent_block_hash: Option<i64>,
        token_ids: Vec<u64>,
        block_size: u32,
        medium: Medium,
    ) -> BlockStored {
        BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium,
            cache_salt: None,
            session_id: None,
            lora_name: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<i64>,
    pub medium: Medium,
}

/// Collects the page-by-page changes of one cache operation as SGLang's events, merging a
/// store into the previous event when it continues that event's chain on the same medium,
/// and a removal into the previous removal on the same medium. Only adjacent changes merge,
/// so the events replay the changes in their exact order.
#[derive(Debug)]
pub struct Journal {
    block_size: u32,
    events: Vec<Event>,
}

impl Journal {
    pub fn new(block_size: u32) -> Journal {
        Journal {
            block_size,
            events: Vec::new(),
        }
    }

    pub fn stored(&mut self, medium: Medium, hash: i64, parent: Option<i64>, tokens: &[u64]) {
        if let Some(Event::BlockStored(last)) = self.events.last_mut()
            && last.medium == medium
            && parent.is_some()
            && last.block_hashes.last().copied() == parent
        {
            last.block_hashes.push(hash);
            last.token_ids.extend_from_slice(tokens);
            return;
        }
        self.events.push(Event::BlockStored(BlockStored::new(
            vec![hash],
            parent,
            tokens.to_vec(),
            self.block_size,
            medium,
        )));
    }

    pub fn removed(&mut self, medium: Medium, hash: i64) {
        if let Some(Event::BlockRemoved(last)) = self.events.last_mut()
            && last.medium == medium
        {
            last.block_hashes.push(hash);
            return;
        }
        self.events.push(Event::BlockRemoved(BlockRemoved {
            block_hashes: vec![hash],
            medium,
        }));
    }

    pub fn cleared(&mut self) {
        self.events.push(Event::AllBlocksCleared);
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    pub fn into_events(self) -> Vec<Event> {
        self.events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[i64], parent: Option<i64>, medium: Medium) -> Event {
        let tokens = hashes.iter().flat_map(|&h| [h as u64, h as u64]).collect();
        Event::BlockStored(BlockStored::new(hashes.to_vec(), parent, tokens, 2, medium))
    }

    fn removed(hashes: &[i64], medium: Medium) -> Event {
        Event::BlockRemoved(BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium,
        })
    }

    enum Change {
        Store(Medium, i64, Option<i64>),
        Remove(Medium, i64),
        Clear,
    }

    fn check(changes: &[Change], expect: &[Event]) {
        let mut journal = Journal::new(2);
        for change in changes {
            match *change {
                Change::Store(medium, hash, parent) => {
                    journal.stored(medium, hash, parent, &[hash as u64, hash as u64]);
                }
                Change::Remove(medium, hash) => journal.removed(medium, hash),
                Change::Clear => journal.cleared(),
            }
        }
        assert_eq!(journal.into_events(), expect);
    }

    #[test]
    fn coalesces_a_chain_on_one_medium() {
        use Change::*;
        use Medium::*;
        check(
            &[
                Store(Gpu, 1, None),
                Store(Gpu, 2, Some(1)),
                Store(Gpu, 3, Some(2)),
            ],
            &[stored(&[1, 2, 3], None, Gpu)],
        );
        check(
            &[Store(Gpu, 5, Some(4)), Store(Gpu, 6, Some(5))],
            &[stored(&[5, 6], Some(4), Gpu)],
        );
    }

    #[test]
    fn starts_a_new_event_when_the_chain_or_medium_breaks() {
        use Change::*;
        use Medium::*;
        check(
            &[
                Store(Gpu, 1, None),
                Store(Gpu, 2, None),
                Store(Gpu, 3, Some(1)),
                Store(CpuPinned, 4, Some(3)),
            ],
            &[
                stored(&[1], None, Gpu),
                stored(&[2], None, Gpu),
                stored(&[3], Some(1), Gpu),
                stored(&[4], Some(3), CpuPinned),
            ],
        );
    }

    #[test]
    fn coalesces_adjacent_removals_per_medium_and_keeps_order() {
        use Change::*;
        use Medium::*;
        check(
            &[
                Remove(Gpu, 3),
                Remove(Gpu, 2),
                Store(CpuPinned, 2, None),
                Remove(CpuPinned, 9),
                Remove(CpuPinned, 8),
                Remove(Gpu, 1),
                Clear,
                Store(Gpu, 1, None),
            ],
            &[
                removed(&[3, 2], Gpu),
                stored(&[2], None, CpuPinned),
                removed(&[9, 8], CpuPinned),
                removed(&[1], Gpu),
                Event::AllBlocksCleared,
                stored(&[1], None, Gpu),
            ],
        );
    }
}
