//! The index cell the state's one writer changes and every reader shares, and the guard that
//! keeps a half-changed index from ever being served.

use std::sync::Arc;

use kv_index::Index;
use parking_lot::RwLock;

/// The index, shared by the readers (the service) and the one writer thread (a single server's
/// writer, or a replica's applier).
pub type IndexCell = Arc<RwLock<Index>>;

/// A new, empty index cell.
pub fn empty() -> IndexCell {
    Arc::new(RwLock::new(Index::new()))
}

/// Aborts the process when dropped by a panic's unwinding: held while the index is being
/// changed, where an unwinding panic would release the write lock over a half-applied index
/// that every later query would be served from. Aborting instead leaves recovery to a restart
/// (with the bridges' resync, the index then under-claims, never over-claims).
pub struct AbortOnPanic(pub &'static str);

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!(
                during = self.0,
                "panic while the index was half-changed: aborting rather than serving it"
            );
            eprintln!(
                "kv-indexer: panic while {}: aborting rather than serving a half-changed index",
                self.0
            );
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set in the child process of `a_panic_while_changing_the_index_aborts`.
    const CHILD: &str = "KV_STATE_TEST_PANIC_CHILD";

    #[test]
    fn a_panic_while_changing_the_index_aborts() {
        if std::env::var_os(CHILD).is_some() {
            let _abort = AbortOnPanic("a test apply");
            panic!("a bug inside an apply");
        }
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "cell::tests::a_panic_while_changing_the_index_aborts",
            ])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(output.status.signal(), Some(6), "not aborted: {stderr}");
        assert!(stderr.contains("aborting rather than serving"), "{stderr}");
    }

    #[test]
    fn the_guard_does_nothing_without_a_panic() {
        let guard = AbortOnPanic("a test apply");
        drop(guard);
    }
}
