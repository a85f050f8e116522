//! The simulated engine's paged prefix cache: pages keyed by their block hash, each linked to
//! its parent (the page before it in the prompt), in a device tier and an optional host tier,
//! with leaf-first LRU eviction. Every operation returns the KV events SGLang would publish
//! for it.
//!
//! Invariants (checked by `check_invariants` in the tests):
//! - the cached pages are closed under parents (a page's parent is cached), and so are the
//!   device pages (a device page's parent is on the device): a hit is always a prefix, device
//!   pages first, then host pages;
//! - the device evicts only unpinned pages without device children, least recently used first;
//!   with a host tier they move there, else they are gone. The host evicts only pages without
//!   children, least recently used first, whenever it holds more than its capacity;
//! - a page pinned by a running request stays on the device until its lease is released.
//!
//! Pinning a page pins its whole prefix, so every unpinned device page can be evicted once its
//! device descendants are: the pages the device can free are exactly the unpinned ones.
//!
//! A page lives in one tier at a time: an evicted device page is written back to the host
//! (`BlockRemoved` GPU, then `BlockStored` CPU_PINNED), and a host hit moves it back
//! (`BlockRemoved` CPU_PINNED, then `BlockStored` GPU). SGLang's HiCache may instead keep a
//! write-through host copy; either way the events describe the tiers exactly.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap;

use crate::events::{Event, Journal, Medium};

/// Sizes, in tokens. A capacity holds `capacity / page_size` whole pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    pub page_size: usize,
    pub capacity_tokens: usize,
    /// 0: no host tier (evicted pages are dropped).
    pub host_capacity_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    #[error("cache not flushed: {pinned} pages are in use by running requests")]
    Busy { pinned: usize },
}

/// Counters since creation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub device_pages: usize,
    pub host_pages: usize,
    pub pinned_pages: usize,
    /// Pages found on the device by admissions.
    pub device_hits: u64,
    /// Pages found on the host and reloaded to the device.
    pub host_hits: u64,
    /// Pages newly stored on the device.
    pub stored: u64,
    /// Pages evicted from the device (moved to the host when there is one).
    pub device_evictions: u64,
    /// Pages evicted from the host.
    pub host_evictions: u64,
    /// Pages of admissions that found no room (every device page pinned).
    pub not_stored: u64,
}

/// The cached prefix of a prompt, per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CachedPrefix {
    pub device_pages: usize,
    /// Host pages right after the device ones.
    pub host_pages: usize,
}

/// The pages a running request holds; give it back with [`Cache::release`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a lease pins its pages until released"]
pub struct Lease {
    hashes: Vec<i64>,
}

impl Lease {
    pub fn pages(&self) -> usize {
        self.hashes.len()
    }
}

/// What [`Cache::admit`] did.
#[derive(Debug)]
pub struct Admission {
    /// Pages of the prompt that were already on the device.
    pub device_hit_pages: usize,
    /// Pages found on the host (reloaded to the device, so a hit too).
    pub host_hit_pages: usize,
    /// Pages stored for the first time.
    pub stored_pages: usize,
    pub lease: Lease,
    pub events: Vec<Event>,
}

impl Admission {
    /// The prompt's cached prefix, in pages.
    pub fn cached_pages(&self) -> usize {
        self.device_hit_pages + self.host_hit_pages
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Device,
    Host,
    /// Off the host and about to be on the device, within one admission.
    Moving,
}

#[derive(Debug)]
struct Page {
    parent: Option<i64>,
    tokens: Box<[u64]>,
    place: Place,
    /// The logical time of the last admission or release that touched it.
    last_used: u64,
    /// Running requests holding it.
    pins: u32,
    /// Cached children, in any place.
    children: u32,
    /// Children on the device.
    device_children: u32,
}

#[derive(Debug)]
pub struct Cache {
    page_size: usize,
    device_capacity: usize,
    host_capacity: usize,
    pages: FxHashMap<i64, Page>,
    device_len: usize,
    host_len: usize,
    pinned_len: usize,
    /// Device pages the device may evict now, by `(last_used, hash)`.
    device_leaves: BTreeSet<(u64, i64)>,
    /// Host pages the host may evict now, by `(last_used, hash)`.
    host_leaves: BTreeSet<(u64, i64)>,
    clock: u64,
    stats: CacheStats,
}

impl Cache {
    pub fn new(config: CacheConfig) -> Cache {
        let page_size = config.page_size.max(1);
        Cache {
            page_size,
            device_capacity: config.capacity_tokens / page_size,
            host_capacity: config.host_capacity_tokens / page_size,
            pages: FxHashMap::default(),
            device_len: 0,
            host_len: 0,
            pinned_len: 0,
            device_leaves: BTreeSet::new(),
            host_leaves: BTreeSet::new(),
            clock: 0,
            stats: CacheStats::default(),
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// How much of the chained `hashes` the cache holds, as [`Cache::admit`] would find it:
    /// pages on the device from the first, then pages on the host after them. Changes nothing.
    pub fn prefix(&self, hashes: &[i64]) -> CachedPrefix {
        let device_pages = hashes
            .iter()
            .take_while(|h| self.place(**h) == Some(Place::Device))
            .count();
        let host_pages = hashes[device_pages..]
            .iter()
            .take_while(|h| self.place(**h) == Some(Place::Host))
            .count();
        CachedPrefix {
            device_pages,
            host_pages,
        }
    }

    /// Starts a request whose prompt's whole pages have the chained `hashes` (page `i` holding
    /// `tokens[i * page_size..(i + 1) * page_size]`): finds its cached prefix, reloads the
    /// host part of it to the device, stores the rest (evicting as needed) and pins all of it.
    ///
    /// When the device cannot make room (its other pages are all pinned), only the pages that
    /// fit are placed; the rest of the prompt is neither cached nor pinned.
    ///
    /// `hashes` must be a chain as block hashes are: a hash always follows the same parent
    /// (SHA-256 chaining makes that so), so a page missing from the cache has no cached
    /// descendants.
    pub fn admit(&mut self, hashes: &[i64], tokens: &[u64]) -> Admission {
        self.clock += 1;
        let now = self.clock;
        let mut journal = Journal::new(self.page_size as u32);

        let CachedPrefix {
            device_pages: device_hit,
            host_pages: host_hit,
        } = self.prefix(hashes);
        for &hash in &hashes[..device_hit] {
            self.pin(hash, now);
        }

        let needed = hashes.len() - device_hit;
        let free = self.device_capacity.saturating_sub(self.device_len);
        let evictable = self.device_len - self.pinned_len;
        let placeable = needed.min(free + evictable);
        let reload = host_hit.min(placeable);

        let moving = &hashes[device_hit..device_hit + reload];
        for &hash in moving {
            self.update(hash, |page| page.place = Place::Moving);
            self.host_len -= 1;
            journal.removed(Medium::CpuPinned, hash);
        }
        if placeable > free {
            self.evict_device(placeable - free, &mut journal);
        }
        for (i, &hash) in hashes.iter().enumerate().skip(device_hit).take(placeable) {
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            if i < device_hit + reload {
                self.update(hash, |page| page.place = Place::Device);
            } else {
                debug_assert!(!self.pages.contains_key(&hash), "{hash} is not a chain");
                let start = (i * self.page_size).min(tokens.len());
                let end = ((i + 1) * self.page_size).min(tokens.len());
                self.pages.insert(
                    hash,
                    Page {
                        parent,
                        tokens: tokens[start..end].into(),
                        place: Place::Device,
                        last_used: now,
                        pins: 0,
                        children: 0,
                        device_children: 0,
                    },
                );
                if let Some(parent) = parent {
                    self.update(parent, |page| page.children += 1);
                }
            }
            if let Some(parent) = parent {
                self.update(parent, |page| page.device_children += 1);
            }
            self.device_len += 1;
            self.pin(hash, now);
            journal.stored(Medium::Gpu, hash, parent, &self.pages[&hash].tokens);
        }

        self.stats.device_hits += device_hit as u64;
        self.stats.host_hits += reload as u64;
        self.stats.stored += (placeable - reload) as u64;
        self.stats.not_stored += (needed - placeable) as u64;
        Admission {
            device_hit_pages: device_hit,
            host_hit_pages: reload,
            stored_pages: placeable - reload,
            lease: Lease {
                hashes: hashes[..device_hit + placeable].to_vec(),
            },
            events: journal.into_events(),
        }
    }

    /// Ends a request: its pages are unpinned and count as used now.
    pub fn release(&mut self, lease: Lease) {
        self.clock += 1;
        let now = self.clock;
        for hash in lease.hashes {
            let Some(page) = self.pages.get(&hash) else {
                continue;
            };
            if page.pins == 1 {
                self.pinned_len -= 1;
            }
            self.update(hash, |page| {
                page.pins = page.pins.saturating_sub(1);
                page.last_used = now;
            });
        }
    }

    /// Drops every page of every tier, as SGLang's `/flush_cache`: refused while requests run.
    pub fn flush(&mut self) -> Result<Vec<Event>, CacheError> {
        if self.pinned_len > 0 {
            return Err(CacheError::Busy {
                pinned: self.pinned_len,
            });
        }
        self.pages.clear();
        self.device_leaves.clear();
        self.host_leaves.clear();
        self.device_len = 0;
        self.host_len = 0;
        Ok(vec![Event::AllBlocksCleared])
    }

    /// The hashes held per tier (tiers holding nothing are absent).
    pub fn held(&self) -> BTreeMap<Medium, BTreeSet<i64>> {
        let mut held: BTreeMap<Medium, BTreeSet<i64>> = BTreeMap::new();
        for (&hash, page) in &self.pages {
            let medium = match page.place {
                Place::Device => Medium::Gpu,
                Place::Host => Medium::CpuPinned,
                Place::Moving => continue,
            };
            held.entry(medium).or_default().insert(hash);
        }
        held
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            device_pages: self.device_len,
            host_pages: self.host_len,
            pinned_pages: self.pinned_len,
            ..self.stats
        }
    }

    fn place(&self, hash: i64) -> Option<Place> {
        self.pages.get(&hash).map(|page| page.place)
    }

    fn pin(&mut self, hash: i64, now: u64) {
        if self.pages[&hash].pins == 0 {
            self.pinned_len += 1;
        }
        self.update(hash, |page| {
            page.pins += 1;
            page.last_used = now;
        });
    }

    /// Changes a page, keeping the eviction candidate sets in step with it.
    fn update(&mut self, hash: i64, change: impl FnOnce(&mut Page)) {
        let Some(page) = self.pages.get_mut(&hash) else {
            return;
        };
        let before = (page.last_used, hash);
        self.device_leaves.remove(&before);
        self.host_leaves.remove(&before);
        change(page);
        let after = (page.last_used, hash);
        match page.place {
            Place::Device if page.pins == 0 && page.device_children == 0 => {
                self.device_leaves.insert(after);
            }
            Place::Host if page.children == 0 => {
                self.host_leaves.insert(after);
            }
            _ => {}
        }
    }

    /// Evicts up to `count` device pages, least recently used leaves first; with a host tier
    /// they move there (which may make the host evict).
    fn evict_device(&mut self, count: usize, journal: &mut Journal) {
        let mut evicted = Vec::with_capacity(count);
        while evicted.len() < count {
            let Some((_, hash)) = self.device_leaves.pop_first() else {
                break;
            };
            self.device_len -= 1;
            let parent = self.pages[&hash].parent;
            self.update(hash, |page| page.place = Place::Moving);
            if let Some(parent) = parent {
                self.update(parent, |page| page.device_children -= 1);
            }
            journal.removed(Medium::Gpu, hash);
            evicted.push(hash);
        }
        self.stats.device_evictions += evicted.len() as u64;
        if self.host_capacity == 0 {
            for hash in evicted {
                self.delete(hash);
            }
            return;
        }
        for hash in parents_first(&evicted, |hash| self.pages[&hash].parent) {
            self.update(hash, |page| page.place = Place::Host);
            self.host_len += 1;
            let page = &self.pages[&hash];
            journal.stored(Medium::CpuPinned, hash, page.parent, &page.tokens);
        }
        while self.host_len > self.host_capacity {
            let Some((_, hash)) = self.host_leaves.pop_first() else {
                break;
            };
            self.host_len -= 1;
            self.stats.host_evictions += 1;
            journal.removed(Medium::CpuPinned, hash);
            self.delete(hash);
        }
    }

    /// Forgets a page that is in no tier any more (it has no children).
    fn delete(&mut self, hash: i64) {
        let Some(page) = self.pages.remove(&hash) else {
            return;
        };
        self.device_leaves.remove(&(page.last_used, hash));
        self.host_leaves.remove(&(page.last_used, hash));
        if let Some(parent) = page.parent {
            self.update(parent, |page| page.children -= 1);
        }
    }
}

/// `pages` ordered so that each parent comes before its children and each chain is as long a
/// run as the branching allows (a depth-first walk from the pages whose parent is not among
/// them), so the host's `BlockStored` events coalesce.
fn parents_first(pages: &[i64], parent_of: impl Fn(i64) -> Option<i64>) -> Vec<i64> {
    let members: rustc_hash::FxHashSet<i64> = pages.iter().copied().collect();
    let mut children: FxHashMap<i64, Vec<i64>> = FxHashMap::default();
    let mut roots = Vec::new();
    // Eviction order is leaves first: reversed, parents come first.
    for &hash in pages.iter().rev() {
        match parent_of(hash).filter(|p| members.contains(p)) {
            Some(parent) => children.entry(parent).or_default().push(hash),
            None => roots.push(hash),
        }
    }
    let mut ordered = Vec::with_capacity(pages.len());
    let mut stack: Vec<i64> = roots.into_iter().rev().collect();
    while let Some(hash) = stack.pop() {
        ordered.push(hash);
        if let Some(kids) = children.get(&hash) {
            stack.extend(kids.iter().rev());
        }
    }
    ordered
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{BlockRemoved, BlockStored};

    const PAGE: usize = 2;

    fn cache(device_pages: usize, host_pages: usize) -> Cache {
        Cache::new(CacheConfig {
            page_size: PAGE,
            capacity_tokens: device_pages * PAGE,
            host_capacity_tokens: host_pages * PAGE,
        })
    }

    /// A prompt of named pages: page `p` holds tokens `[p, p]` and its hash is `p` (the cache
    /// does not hash; chains are given by position).
    fn prompt(pages: &[i64]) -> (Vec<i64>, Vec<u64>) {
        let tokens = pages.iter().flat_map(|&p| [p as u64, p as u64]).collect();
        (pages.to_vec(), tokens)
    }

    fn admit(cache: &mut Cache, pages: &[i64]) -> Admission {
        let (hashes, tokens) = prompt(pages);
        let admission = cache.admit(&hashes, &tokens);
        check_invariants(cache);
        admission
    }

    /// Admits and releases at once: a request that finished.
    fn run(cache: &mut Cache, pages: &[i64]) -> Vec<Event> {
        let admission = admit(cache, pages);
        cache.release(admission.lease);
        check_invariants(cache);
        admission.events
    }

    fn stored(hashes: &[i64], parent: Option<i64>, medium: Medium) -> Event {
        let (_, tokens) = prompt(hashes);
        Event::BlockStored(BlockStored::new(
            hashes.to_vec(),
            parent,
            tokens,
            PAGE as u32,
            medium,
        ))
    }

    fn removed(hashes: &[i64], medium: Medium) -> Event {
        Event::BlockRemoved(BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium,
        })
    }

    fn held(device: &[i64], host: &[i64]) -> BTreeMap<Medium, BTreeSet<i64>> {
        let mut held = BTreeMap::new();
        if !device.is_empty() {
            held.insert(Medium::Gpu, device.iter().copied().collect());
        }
        if !host.is_empty() {
            held.insert(Medium::CpuPinned, host.iter().copied().collect());
        }
        held
    }

    /// Recomputes every count and candidate set from the pages and compares.
    fn check_invariants(cache: &Cache) {
        let mut device_leaves = BTreeSet::new();
        let mut host_leaves = BTreeSet::new();
        let (mut device, mut host, mut pinned) = (0, 0, 0);
        for (&hash, page) in &cache.pages {
            let kids = cache
                .pages
                .values()
                .filter(|p| p.parent == Some(hash))
                .collect::<Vec<_>>();
            let device_kids = kids.iter().filter(|p| p.place == Place::Device).count();
            assert_eq!(page.children as usize, kids.len(), "children of {hash}");
            assert_eq!(page.device_children as usize, device_kids, "of {hash}");
            if let Some(parent) = page.parent {
                let parent = &cache.pages[&parent];
                if page.place == Place::Device {
                    assert_eq!(parent.place, Place::Device, "device parent of {hash}");
                }
            }
            if page.pins > 0 {
                pinned += 1;
                assert_eq!(page.place, Place::Device, "pinned {hash}");
            }
            match page.place {
                Place::Device => {
                    device += 1;
                    if page.pins == 0 && device_kids == 0 {
                        device_leaves.insert((page.last_used, hash));
                    }
                }
                Place::Host => {
                    host += 1;
                    if kids.is_empty() {
                        host_leaves.insert((page.last_used, hash));
                    }
                }
                Place::Moving => panic!("{hash} left moving"),
            }
        }
        assert_eq!(
            (device, host, pinned),
            (cache.device_len, cache.host_len, cache.pinned_len)
        );
        assert!(device <= cache.device_capacity);
        assert!(host <= cache.host_capacity);
        assert_eq!(device_leaves, cache.device_leaves);
        assert_eq!(host_leaves, cache.host_leaves);
    }

    #[test]
    fn stores_a_new_prompt_as_one_chain_and_hits_it_again() {
        let mut cache = cache(8, 0);
        let events = run(&mut cache, &[1, 2, 3]);
        assert_eq!(events, [stored(&[1, 2, 3], None, Medium::Gpu)]);

        let admission = admit(&mut cache, &[1, 2, 4, 5]);
        assert_eq!(admission.device_hit_pages, 2);
        assert_eq!(admission.stored_pages, 2);
        assert_eq!(admission.events, [stored(&[4, 5], Some(2), Medium::Gpu)]);
        assert_eq!(admission.lease.pages(), 4);
        cache.release(admission.lease);
        assert_eq!(cache.held(), held(&[1, 2, 3, 4, 5], &[]));
    }

    #[test]
    fn evicts_least_recently_used_leaves_first() {
        let mut cache = cache(4, 0);
        run(&mut cache, &[1, 2, 3]);
        run(&mut cache, &[1, 4]);
        // Full. The leaves are 3 (older) and 4; 3 goes, then 2, which became a leaf.
        let events = run(&mut cache, &[5, 6]);
        assert_eq!(
            events,
            [
                removed(&[3, 2], Medium::Gpu),
                stored(&[5, 6], None, Medium::Gpu)
            ]
        );
        assert_eq!(cache.held(), held(&[1, 4, 5, 6], &[]));
        // 1 was used as recently as 4 but has a child: only the leaf 4 can go.
        let events = run(&mut cache, &[7]);
        assert_eq!(
            events,
            [removed(&[4], Medium::Gpu), stored(&[7], None, Medium::Gpu)]
        );
        let stats = cache.stats();
        assert_eq!((stats.device_evictions, stats.host_evictions), (3, 0));
    }

    #[test]
    fn never_evicts_pages_of_running_requests() {
        let mut cache = cache(4, 0);
        let running = admit(&mut cache, &[1, 2, 3]);
        // One free page: the new prompt's first page fits, the rest is not stored.
        let admission = admit(&mut cache, &[5, 6]);
        assert_eq!(admission.stored_pages, 1);
        assert_eq!(admission.events, [stored(&[5], None, Medium::Gpu)]);
        assert_eq!(cache.stats().not_stored, 1);
        cache.release(admission.lease);
        // Only 5 is free to go; the running prompt keeps its pages.
        let admission = admit(&mut cache, &[7, 8]);
        assert_eq!(
            admission.events,
            [removed(&[5], Medium::Gpu), stored(&[7], None, Medium::Gpu)]
        );
        assert_eq!(cache.stats().not_stored, 2);
        cache.release(admission.lease);
        cache.release(running.lease);
        check_invariants(&cache);
        assert_eq!(cache.held(), held(&[1, 2, 3, 7], &[]));
    }

    #[test]
    fn moves_evicted_pages_to_the_host_and_evicts_the_host_in_turn() {
        let mut cache = cache(3, 3);
        run(&mut cache, &[1, 2, 3]);
        let events = run(&mut cache, &[4, 5]);
        assert_eq!(
            events,
            [
                removed(&[3, 2], Medium::Gpu),
                stored(&[2, 3], Some(1), Medium::CpuPinned),
                stored(&[4, 5], None, Medium::Gpu),
            ]
        );
        assert_eq!(cache.held(), held(&[1, 4, 5], &[2, 3]));
        // Three more pages: 1 (the oldest leaf once 2 left), then 5 and 4 move to the host,
        // which keeps three pages: its oldest leaves, 3 and then 2, are dropped.
        let events = run(&mut cache, &[6, 7, 8]);
        assert_eq!(
            events,
            [
                removed(&[1, 5, 4], Medium::Gpu),
                stored(&[4, 5], None, Medium::CpuPinned),
                stored(&[1], None, Medium::CpuPinned),
                removed(&[3, 2], Medium::CpuPinned),
                stored(&[6, 7, 8], None, Medium::Gpu),
            ]
        );
        assert_eq!(cache.held(), held(&[6, 7, 8], &[1, 4, 5]));
        let stats = cache.stats();
        assert_eq!((stats.device_evictions, stats.host_evictions), (5, 2));
    }

    #[test]
    fn a_host_hit_reloads_the_pages_to_the_device() {
        let mut cache = cache(3, 3);
        run(&mut cache, &[1, 2, 3]);
        run(&mut cache, &[4, 5, 6]);
        assert_eq!(cache.held(), held(&[4, 5, 6], &[1, 2, 3]));
        let admission = admit(&mut cache, &[1, 2, 9]);
        assert_eq!(
            (
                admission.device_hit_pages,
                admission.host_hit_pages,
                admission.stored_pages
            ),
            (0, 2, 1)
        );
        assert_eq!(
            admission.events,
            [
                removed(&[1, 2], Medium::CpuPinned),
                removed(&[6, 5, 4], Medium::Gpu),
                stored(&[4, 5, 6], None, Medium::CpuPinned),
                removed(&[3], Medium::CpuPinned),
                stored(&[1, 2, 9], None, Medium::Gpu),
            ]
        );
        cache.release(admission.lease);
        assert_eq!(cache.held(), held(&[1, 2, 9], &[4, 5, 6]));
        assert_eq!(cache.stats().host_hits, 2);
    }

    #[test]
    fn a_device_prefix_then_a_host_suffix_is_one_hit() {
        let mut cache = cache(3, 4);
        run(&mut cache, &[1, 2, 3]);
        run(&mut cache, &[1, 4, 5]);
        // 2 and 3 went to the host; 1 stayed (it had a device child).
        assert_eq!(cache.held(), held(&[1, 4, 5], &[2, 3]));
        let admission = admit(&mut cache, &[1, 2, 3]);
        assert_eq!(
            (admission.device_hit_pages, admission.host_hit_pages),
            (1, 2)
        );
        assert_eq!(
            admission.events,
            [
                removed(&[2, 3], Medium::CpuPinned),
                removed(&[5, 4], Medium::Gpu),
                stored(&[4, 5], Some(1), Medium::CpuPinned),
                stored(&[2, 3], Some(1), Medium::Gpu),
            ]
        );
        cache.release(admission.lease);
        assert_eq!(cache.held(), held(&[1, 2, 3], &[4, 5]));
    }

    #[test]
    fn flush_clears_every_tier_unless_requests_run() {
        let mut cache = cache(2, 2);
        run(&mut cache, &[1, 2]);
        let running = admit(&mut cache, &[3]);
        assert_eq!(cache.flush(), Err(CacheError::Busy { pinned: 1 }));
        cache.release(running.lease);
        assert_eq!(cache.held(), held(&[3, 1], &[2]));
        assert_eq!(cache.flush(), Ok(vec![Event::AllBlocksCleared]));
        assert_eq!(cache.held(), held(&[], &[]));
        check_invariants(&cache);
        // Flushing an empty cache still publishes the clear, as SGLang does.
        assert_eq!(cache.flush(), Ok(vec![Event::AllBlocksCleared]));
        let events = run(&mut cache, &[1, 2]);
        assert_eq!(events, [stored(&[1, 2], None, Medium::Gpu)]);
    }

    #[test]
    fn a_prompt_longer_than_the_device_stores_what_fits() {
        let mut cache = cache(2, 0);
        let admission = admit(&mut cache, &[1, 2, 3, 4]);
        assert_eq!(admission.stored_pages, 2);
        assert_eq!(admission.events, [stored(&[1, 2], None, Medium::Gpu)]);
        cache.release(admission.lease);
        assert_eq!(cache.stats().not_stored, 2);
    }

    #[test]
    fn the_events_replayed_give_the_cache_its_own_view() {
        // A deterministic random walk over shared prefixes, long enough to evict both tiers.
        let mut cache = cache(16, 12);
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut view: BTreeMap<Medium, BTreeSet<i64>> = BTreeMap::new();
        let mut running = Vec::new();
        for _ in 0..400 {
            // Prompts share prefixes: page k of branch b is `b * 100 + k`, branches fork from
            // branch 0 at page `b % 5`.
            let branch = (next() % 12) as i64;
            let len = 1 + (next() % 9) as i64;
            let pages: Vec<i64> = (0..len)
                .map(|k| if k < branch % 5 { k } else { branch * 100 + k })
                .collect();
            let admission = admit(&mut cache, &pages);
            for event in admission.events {
                apply(&mut view, event);
            }
            running.push(admission.lease);
            if running.len() > 2 || next() % 2 == 0 {
                let lease = running.remove((next() % running.len() as u64) as usize);
                cache.release(lease);
                check_invariants(&cache);
            }
            view.retain(|_, set| !set.is_empty());
            assert_eq!(view, cache.held());
        }
        let stats = cache.stats();
        assert!(stats.host_evictions > 0 && stats.host_hits > 0, "{stats:?}");
        for lease in running {
            cache.release(lease);
        }
        for event in cache.flush().unwrap() {
            apply(&mut view, event);
        }
        assert!(view.is_empty());
    }

    fn apply(view: &mut BTreeMap<Medium, BTreeSet<i64>>, event: Event) {
        match event {
            Event::BlockStored(stored) => {
                let set = view.entry(stored.medium).or_default();
                for hash in stored.block_hashes {
                    assert!(set.insert(hash), "{hash} stored twice");
                }
            }
            Event::BlockRemoved(removed) => {
                let set = view.entry(removed.medium).or_default();
                for hash in removed.block_hashes {
                    assert!(set.remove(&hash), "{hash} removed but not held");
                }
            }
            Event::AllBlocksCleared => view.clear(),
        }
    }

    #[test]
    fn orders_evicted_pages_parents_first_in_long_runs() {
        let parent = |h: i64| match h {
            1 => None,
            2 | 3 => Some(1),
            4 => Some(2),
            _ => Some(0),
        };
        // Leaves first: 4, 3, 2, 1 (and 9, whose parent was not evicted).
        assert_eq!(parents_first(&[4, 9, 3, 2, 1], parent), [1, 2, 4, 3, 9]);
    }
}
