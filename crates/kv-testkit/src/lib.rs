//! Dev-only: what the tests of every crate share, so that no test reads another crate's
//! `tests/` folder or fakes a dead endpoint with a port it bound and dropped.
//!
//! - [`port`]: a loopback port kept for a test's life: refused while nothing listens, served
//!   again after a restart, never taken by anyone else;
//! - [`indexer`]: the real server on a [`port::Port`] in this process, with a raw gRPC client
//!   and what tests ask of it (what a worker holds, how many workers it knows), and the
//!   requests tests send;
//! - [`booted`]: the server booted from a state directory or a shared log, with a client;
//! - [`worker`]: the fake SGLang worker (a ZMQ PUB and a replay ROUTER), SGLang's batch
//!   encoding, and the live messages captured off a real one;
//! - [`bridge`]: the real bridge in this process, configured by its flags;
//! - [`h2`]: HTTP/2 below tonic: a prefix query whose body never comes, and frames written by
//!   hand for a client that opens more streams than the server allows;
//! - [`fixtures`]: the captured SGLang fixtures and their decoding helpers;
//! - [`wait`]: readiness waits on a condition, with a deadline, instead of sleeps;
//! - [`redis`]: a real `redis-server` on a free loopback port, for the fleet tests;
//! - [`tokenizer`]: a tiny Hugging Face `tokenizer.json` that adds a BOS token;
//! - [`temp_dir`] and [`crash_image`]: fresh directories, and what a crash leaves of a state
//!   directory.

pub mod booted;
pub mod bridge;
pub mod fixtures;
pub mod h2;
pub mod indexer;
pub mod port;
pub mod redis;
pub mod tokenizer;
pub mod wait;
pub mod worker;

pub use bridge::{BridgeFlags, RunningBridge};

/// A fresh, empty directory path under the system's temp dir, unique in this process:
/// `<prefix>-<name>-<pid>-<n>` (not created).
pub fn temp_dir(prefix: &str, name: &str) -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("{prefix}-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
/// What a crash leaves of the state directory `dir`: a copy of its files as they are now (an
/// acknowledged record was written before its answer, so it is in them), without the lock, in a
/// new directory from [`temp_dir`]`(prefix, name)`.
pub fn crash_image(dir: &std::path::Path, prefix: &str, name: &str) -> std::path::PathBuf {
    let image = temp_dir(prefix, name);
    std::fs::create_dir_all(&image).expect("creating the crash image");
    for entry in std::fs::read_dir(dir)
        .expect("reading the state directory")
        .flatten()
    {
        let is_file = entry.file_type().is_ok_and(|kind| kind.is_file());
        if entry.file_name() != "LOCK" && is_file {
            std::fs::copy(entry.path(), image.join(entry.file_name()))
                .expect("copying a state file");
        }
    }
    image
}
pub use indexer::TestIndexer;
pub use port::Port;
pub use worker::FakeWorker;
