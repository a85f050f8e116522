//! How the counting allocator counts while Dynamo's write threads may allocate.
//!
//! kv-index's memory build runs on the main thread alone and counts as `benches/replay.rs`
//! does (a plain load and store). The peer's memory build allocates on its write threads too,
//! so it counts with atomic read-modify-writes. Timed phases count nothing, so neither index
//! pays for counting in timed code.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::plan::{Counter, LIVE_BYTES, OneThread};

#[derive(Clone, Copy)]
#[repr(u8)]
pub enum Mode {
    /// Nothing counted: a timed phase of the peer, no measurement open.
    Off = 0,
    /// Only the main thread allocates.
    OneThread = 1,
    /// Other threads allocate too.
    Shared = 2,
}

static MODE: AtomicU8 = AtomicU8::new(Mode::OneThread as u8);

/// Switch modes only between phases, never while another thread allocates.
pub fn set(mode: Mode) {
    MODE.store(mode as u8, Ordering::SeqCst);
}

pub struct Phased;

impl Counter for Phased {
    #[inline]
    fn count(add: usize, sub: usize) {
        match MODE.load(Ordering::Relaxed) {
            1 => OneThread::count(add, sub),
            2 => {
                LIVE_BYTES.fetch_add(add, Ordering::Relaxed);
                LIVE_BYTES.fetch_sub(sub, Ordering::Relaxed);
            }
            _ => {}
        }
    }
}
