//! A snapshot of the live index written by a child process (`fork`), as Redis's `BGSAVE` does:
//! the child sees the index as it was at the fork, copy-on-write, and writes it into the page
//! cache while the writer goes on; once it has exited, a thread of the server writes the file
//! back, syncs and renames it. The child replays nothing, and holds no second index, where
//! building the snapshot again from the previous one and the log did (2.0x at 100 M
//! placements, `bench/durable/README.md`).
//!
//! The block table's pages are not given to the child (`MADV_DONTFORK` for the fork):
//! applies write to the table at random, so had it been shared copy-on-write the applies
//! after a fork would fault on nearly every page of it, one copy each (apply p99 6-10x with a
//! snapshot every second). The child writes a table built afresh from the live blocks
//! ([`Index::write_image_with_fresh_table`]), never touching the missing pages; that costs it
//! a table's worth of memory while it runs. The rest of the index is shared copy-on-write.
//! `KV_INDEXER_SNAPSHOT_METHOD=fork-shared` shares the table too (`TableImage::Own`).
//!
//! The child of a multi-threaded process may only rely on what the fork copied consistently:
//! it reads the index (the writer thread forks it between two changes, so no change is half
//! done), allocates (glibc's allocator is made safe across `fork`), makes plain file syscalls
//! and ends with `_exit`. It logs nothing (a tracing or stderr lock may have been held by
//! another thread at the fork); its error, if any, goes to the parent through a pipe.

#![allow(unsafe_code)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::warn;

use kv_index::Index;

use crate::error::StateError;
use crate::log::StateFileError;
use crate::meta::Meta;
use crate::snapshot::{self, Built, TableImage};

/// A snapshot being written by a child process.
pub(crate) struct Child {
    pid: libc::pid_t,
    /// The read end of the pipe the child writes its error to (closed at its exit).
    errors: std::io::PipeReader,
    dir: PathBuf,
    position: u64,
    start: Instant,
    /// How long the fork held the writer.
    fork: Duration,
    /// Set once the child has exited and is about to be reaped: its pid may then be reused,
    /// so it is no longer signalled.
    reaped: Arc<Mutex<bool>>,
}

/// Stops a snapshot's child (at shutdown, where the final snapshot supersedes it).
pub(crate) struct Stopper {
    pid: libc::pid_t,
    reaped: Arc<Mutex<bool>>,
    started: Instant,
}

impl Stopper {
    /// Kills the child unless it has already exited; its waiter then reports it stopped.
    pub(crate) fn stop(&self) {
        let reaped = self.reaped.lock();
        if !*reaped {
            // SAFETY: a signal to our own child, which is not reaped yet (a zombie at worst),
            // so its pid cannot belong to another process.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
    }

    /// Kills the child if it has run for longer than `bound` and not exited (its waiter then
    /// reports the snapshot failed, killed by signal 9); whether it was still running then.
    pub(crate) fn stop_if_hung(&self, bound: Duration) -> bool {
        if self.started.elapsed() < bound || *self.reaped.lock() {
            return false;
        }
        warn!(
            running_s = self.started.elapsed().as_secs(),
            "the snapshot process has run too long: killed, the next interval tries again"
        );
        self.stop();
        true
    }
}

/// Forks a child that writes the snapshot of `index` and `meta` at `position` into `dir`, with
/// the block table `image`: a child writing a [`TableImage::Fresh`] one is not given the
/// index's table (`MADV_DONTFORK`), a [`TableImage::Own`] one shares it copy-on-write. It is
/// never given `unread` either (the writer's other copy's table), unless that is the index's
/// own (the two copies share it but after a rebuild). Call it on the thread that changes the
/// index, between two changes. `Err` when no child could be made (the caller builds the
/// snapshot another way).
pub(crate) fn spawn(
    dir: &Path,
    position: u64,
    index: &Index,
    unread: std::ops::Range<usize>,
    meta: &Meta,
    image: TableImage,
) -> std::io::Result<Child> {
    let own = index.table_memory();
    let mut withheld = Vec::new();
    if unread != own {
        withheld.push(whole_pages(unread));
    }
    if matches!(image, TableImage::Fresh) {
        withheld.push(whole_pages(own));
    }
    spawn_writing(dir, position, index, meta, &withheld, image)
}

/// [`spawn`], withholding the table or not whatever `image` is: only a test withholds it from
/// a child writing [`TableImage::Own`], to see that such a child cannot read it.
fn spawn_writing(
    dir: &Path,
    position: u64,
    index: &Index,
    meta: &Meta,
    withheld: &[std::ops::Range<usize>],
    image: TableImage,
) -> std::io::Result<Child> {
    let start = Instant::now();
    let (errors, mut report) = std::io::pipe()?;
    // SAFETY: `getpid` has no preconditions.
    let parent = unsafe { libc::getpid() };
    for pages in withheld {
        if let Err(error) = set_fork_advice(pages, libc::MADV_DONTFORK) {
            warn!(%error, "cannot keep a block table out of the snapshot process: applies may stall after the fork");
        }
    }
    // SAFETY: the child runs only `child_main`, which keeps to what is safe after a fork in a
    // multi-threaded process (the module's documentation) and never returns; when the table
    // is withheld it never reads it (it writes a fresh one).
    let forked = match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()),
        pid => Ok(pid),
    };
    if !matches!(forked, Ok(0)) {
        // Failing, a later fork (only ours) would not get these pages either: harmless.
        for pages in withheld {
            let _ = set_fork_advice(pages, libc::MADV_DOFORK);
        }
    }
    match forked? {
        0 => child_main(parent, dir, position, index, meta, image, &mut report),
        pid => Ok(Child {
            pid,
            errors,
            dir: dir.to_path_buf(),
            position,
            start,
            fork: start.elapsed(),
            reaped: Arc::new(Mutex::new(false)),
        }),
    }
}

/// The whole memory pages within `range`.
fn whole_pages(range: std::ops::Range<usize>) -> std::ops::Range<usize> {
    // SAFETY: `sysconf` has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let start = range.start.next_multiple_of(page);
    let end = range.end - range.end % page;
    start..end.max(start)
}

/// Whether a child forked from now on gets the pages of `pages` (`MADV_DOFORK`) or not
/// (`MADV_DONTFORK`). Only advice: if it fails, the child gets them, which costs copy-on-write
/// faults but is still correct.
fn set_fork_advice(pages: &std::ops::Range<usize>, advice: libc::c_int) -> std::io::Result<()> {
    if pages.is_empty() {
        return Ok(());
    }
    // SAFETY: whole pages of the index's table, which stays allocated: the writer thread,
    // the only one that changes (and so reallocates) it, is the one calling this around its
    // fork. The advice changes only what a fork copies.
    match unsafe { libc::madvise(pages.start as *mut libc::c_void, pages.len(), advice) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

impl Child {
    pub(crate) fn stopper(&self) -> Stopper {
        Stopper {
            pid: self.pid,
            reaped: self.reaped.clone(),
            started: self.start,
        }
    }

    /// Waits for the child, then makes its file durable and visible.
    pub(crate) fn wait(mut self) -> Result<Built, StateError> {
        let mut why = String::new();
        // Returns at the child's exit, when the write end closes.
        let _ = self.errors.read_to_string(&mut why);
        *self.reaped.lock() = true;
        let mut status = 0;
        loop {
            // SAFETY: waits for our own child; `status` is a valid out pointer.
            let waited = unsafe { libc::waitpid(self.pid, &mut status, 0) };
            if waited == self.pid {
                break;
            }
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::Interrupted {
                return Err(self.failed(format!("waiting for the snapshot process: {error}")));
            }
        }
        if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
            if why.is_empty() {
                why = match libc::WIFSIGNALED(status) {
                    true => format!("killed by signal {}", libc::WTERMSIG(status)),
                    false => format!("exit status {}", libc::WEXITSTATUS(status)),
                };
            }
            let _ = std::fs::remove_file(snapshot::tmp_path(&self.dir, self.position));
            return Err(self.failed(format!("the snapshot process failed: {why}")));
        }
        snapshot::publish(&self.dir, self.position, false)?;
        let target = snapshot::path(&self.dir, self.position);
        let bytes = std::fs::metadata(&target)
            .map_err(crate::log::io("reading the size of", &target))?
            .len();
        Ok(Built {
            position: self.position,
            bytes,
            took: self.start.elapsed(),
            fork: self.fork,
        })
    }

    fn failed(&self, what: String) -> StateError {
        StateError::Log(StateFileError::Corrupt {
            path: snapshot::path(&self.dir, self.position),
            offset: 0,
            what,
        })
    }
}

/// The child: dies with the parent, closes what it inherited but its pipe, takes signals by
/// default, runs at the idle scheduling class, writes the snapshot and exits (0: written; 1: an error, sent through `report`).
fn child_main(
    parent: libc::pid_t,
    dir: &Path,
    position: u64,
    index: &Index,
    meta: &Meta,
    image: TableImage,
    report: &mut std::io::PipeWriter,
) -> ! {
    use std::os::fd::AsRawFd;
    let keep = report.as_raw_fd() as libc::c_uint;
    // SAFETY: plain syscalls with no pointers but `param`, which outlives the call; the
    // descriptors closed are the child's copies (the server's listeners and its directory
    // lock stay the parent's alone), and nothing in the child uses them.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() != parent {
            libc::_exit(3);
        }
        if keep > 3 {
            close_from_to(3, keep - 1);
        }
        close_from_to(keep + 1, libc::c_uint::MAX);
        // The parent's handlers write to its signal pipes; a Ctrl-C or SIGTERM ends the child.
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
            libc::signal(signal, libc::SIG_DFL);
        }
        let param = libc::sched_param { sched_priority: 0 };
        libc::sched_setscheduler(0, libc::SCHED_IDLE, &param);
    }
    // The child holds a table's worth of memory beside the server's: under a memory limit
    // the OOM killer should take it, not the server (as Redis's background save does).
    let _ = std::fs::write("/proc/self/oom_score_adj", "1000");
    // Only into the page cache: the parent's thread writes it back and syncs it once the
    // child is gone, so the child (and the copies of pages it keeps shared) lives no longer
    // than the serialization.
    let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        snapshot::write_tmp(dir, position, index, meta, false, image)
    }));
    let code = match written {
        Ok(Ok(_)) => 0,
        Ok(Err(error)) => {
            let _ = report.write_all(kv_common::error_chain(&error).as_bytes());
            1
        }
        Err(_) => {
            let _ = report.write_all(b"panicked while writing");
            2
        }
    };
    // SAFETY: ends the child at once, running no destructor and no exit handler of the parent.
    unsafe { libc::_exit(code) }
}

/// Closes the descriptors `first..=last`: the `close_range` system call (Linux 5.9) made
/// directly, since glibc exports its wrapper only from 2.34 and the wheel targets 2.17; on an
/// older kernel (ENOSYS), one `close` each up to the descriptor limit.
///
/// # Safety
/// Closes descriptors others may hold: only for a child after `fork`, which shares no thread.
unsafe fn close_from_to(first: libc::c_uint, last: libc::c_uint) {
    // SAFETY: the caller's; the call takes no pointer.
    let done = unsafe { libc::syscall(libc::SYS_close_range, first, last, 0 as libc::c_uint) };
    if done == 0 {
        return;
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` outlives the call that writes it.
    let known = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    let open_max = if known {
        limit.rlim_cur.min(1 << 20)
    } else {
        1 << 16
    };
    let end = u64::from(last).min(open_max.saturating_sub(1));
    for fd in u64::from(first)..=end {
        // SAFETY: the caller's; EBADF for a descriptor that is not open is harmless.
        unsafe { libc::close(fd as libc::c_int) };
    }
}

#[cfg(test)]
mod tests {
    use kv_index::{ActionRequest, ApplyRequest};

    use super::*;
    use crate::snapshot::tests::{same, sample, scratch_dir};

    #[test]
    fn the_child_writes_the_index_as_it_was_at_the_fork() {
        let (mut index, meta) = sample();
        let before = Index::import(&index.export());
        let dir = scratch_dir("forked");
        let child = spawn(&dir, 9, &index, 0..0, &meta, TableImage::Own).unwrap();
        // The parent goes on changing its index; the child's copy does not see it.
        let request = ApplyRequest {
            worker_id: "w-new".into(),
            seq: 0,
            worker_address: "http://w-new".into(),
            cache_spec: None,
            actions: vec![ActionRequest {
                action_type: 1,
                tier: 1,
                component_masks: vec![0; 8],
                block_sizes: vec![16; 8],
                hashes: (500..508).collect(),
                parent_block_hash: None,
            }],
        };
        index.apply(&request.validate().unwrap());
        let built = child.wait().unwrap();
        let file = snapshot::path(&dir, 9);
        assert_eq!(built.position, 9);
        assert_eq!(built.bytes, std::fs::metadata(&file).unwrap().len());
        same(&snapshot::read(&file).unwrap(), &before, &meta, 9);
        assert_ne!(before.export(), index.export());
    }

    /// A REPORT (1) or REVOKE (2) of `hashes` by worker `id`.
    fn change(id: &str, action_type: i32, hashes: std::ops::Range<i64>) -> kv_index::ValidApply {
        let len = match action_type {
            1 => hashes.end.saturating_sub(hashes.start) as usize,
            _ => 0,
        };
        let request = ApplyRequest {
            worker_id: id.into(),
            seq: 0,
            worker_address: format!("http://{id}"),
            cache_spec: None,
            actions: vec![ActionRequest {
                action_type,
                tier: 1,
                component_masks: vec![0; len],
                block_sizes: vec![16; len],
                hashes: hashes.collect(),
                parent_block_hash: None,
            }],
        };
        request.validate().unwrap()
    }

    #[test]
    fn a_child_without_the_tables_pages_writes_the_index_whole() {
        // Big enough that the table spans many whole pages, which the child does not get: a
        // child that read them would die of a segmentation fault.
        let (mut index, meta) = sample();
        for (w, start) in [
            ("w-1", 1_000),
            ("w-2", 20_000),
            ("w-3", 40_000),
            ("w-4", 55_000),
        ] {
            index.apply(&change(w, 1, start..start + 12_000));
        }
        index.apply(&change("w-1", 1, 70_000..70_500));
        index.apply(&change("w-1", 2, 1_000..5_000));
        assert!(whole_pages(index.table_memory()).len() >= 64 * 4096);
        let before = index.export().canonical();
        let dir = scratch_dir("forked-big");
        // The writer's other copy, whose table the child does not get either.
        let mut other = index.clone();
        let unread = other.table_memory();
        let child = spawn(&dir, 4, &index, unread, &meta, TableImage::Fresh).unwrap();
        index.apply(&change("w-5", 1, 80_000..82_000));
        other.apply(&change("w-5", 1, 80_000..82_000));
        child.wait().unwrap();
        let read = snapshot::read(&snapshot::path(&dir, 4)).unwrap();
        read.index.check_invariants();
        assert_eq!((read.position, &read.meta), (4, &meta));
        assert!(
            read.index.export().canonical() == before,
            "the index as at the fork"
        );
        assert!(index.export().canonical() != before);
    }

    /// The published copy's table is shared with the writer's copy, which has filled it
    /// further: a child writing it as it is (`ForkShared`) is given it, and its image loads as
    /// the published copy held.
    #[test]
    fn a_child_writing_a_shared_table_writes_the_copy_it_was_given() {
        let (mut index, meta) = sample();
        index.apply(&change("w-1", 1, 1_000..13_000));
        let room = index.table_for(20_000).expect("20,000 more do not fit");
        drop(index.install_table(room).expect("built from it"));
        let published = index.twin();
        index.apply(&change("w-2", 1, 20_000..35_000));
        index.apply(&change("w-1", 2, 1_000..5_000));
        let dir = scratch_dir("forked-shared");
        let unread = index.table_memory();
        assert_eq!(unread, published.table_memory(), "one table");
        let child = spawn(&dir, 6, &published, unread, &meta, TableImage::Own).unwrap();
        child.wait().unwrap();
        let read = snapshot::read(&snapshot::path(&dir, 6)).unwrap();
        read.index.check_invariants();
        assert!(read.index.export().canonical() == published.export().canonical());
        assert_eq!(read.index.stats().blocks, published.stats().blocks);
        assert!(
            index.stats().blocks > published.stats().blocks,
            "the writer's copy is ahead"
        );
    }

    #[test]
    fn a_child_reading_the_withheld_table_dies() {
        let (mut index, meta) = sample();
        index.apply(&change("w-1", 1, 1_000..13_000));
        let dir = scratch_dir("forked-reads-table");
        let withheld = [whole_pages(index.table_memory())];
        let child = spawn_writing(&dir, 5, &index, &meta, &withheld, TableImage::Own);
        let text = kv_common::error_chain(&child.unwrap().wait().unwrap_err());
        assert!(text.contains("killed by signal 11"), "{text}");
    }

    #[test]
    fn a_child_that_cannot_write_says_why() {
        let (index, meta) = sample();
        let dir = scratch_dir("forked-nowhere").join("missing");
        let error = spawn(&dir, 3, &index, 0..0, &meta, TableImage::Fresh)
            .unwrap()
            .wait()
            .unwrap_err();
        let text = kv_common::error_chain(&error);
        assert!(text.contains("the snapshot process failed"), "{text}");
        assert!(
            text.contains("creating") && text.contains("No such file"),
            "{text}"
        );
    }

    /// A child that stops making progress (here: stopped with SIGSTOP, as a deadlock or a dead
    /// disk would leave it) is killed by the watchdog once past its bound, and the snapshot
    /// reports the signal; a child within its bound is left alone.
    #[test]
    fn the_watchdog_kills_a_hung_child() {
        let (index, meta) = sample();
        let dir = scratch_dir("forked-hung");
        // The sample is small: a child may finish before the stop reaches it (then its
        // snapshot is written and the attempt is made again, at most a few times).
        let (stopper, waiting) = (0..5)
            .find_map(|_| {
                let child = spawn(&dir, 4, &index, 0..0, &meta, TableImage::Fresh).unwrap();
                // SAFETY: a signal to our own child, not yet reaped.
                unsafe { libc::kill(child.pid, libc::SIGSTOP) };
                let stopper = child.stopper();
                let waiting = crate::snapshot::spawn_builder(move || child.wait()).unwrap();
                std::thread::sleep(Duration::from_millis(200));
                if waiting.is_finished() {
                    let _ = waiting.join();
                    let _ = std::fs::remove_file(snapshot::path(&dir, 4));
                    return None;
                }
                Some((stopper, waiting))
            })
            .expect("a stopped child finished every time");
        assert!(!stopper.stop_if_hung(Duration::from_secs(60)));
        assert!(stopper.stop_if_hung(Duration::from_millis(100)));
        let text = kv_common::error_chain(&waiting.join().unwrap().unwrap_err());
        assert!(text.contains("killed by signal 9"), "{text}");
        assert!(!snapshot::path(&dir, 4).exists());
    }
}
