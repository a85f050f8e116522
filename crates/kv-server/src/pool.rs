//! The query threads: prefix scans run on threads of their own, below the priority of the
//! runtime that serves HTTP/2, instead of on that runtime.
//!
//! Why (measured with `scripts/overload.py` on one core): whatever runs a scan delays the
//! reading of request heads. With scans on the runtime, under overload the heads of new requests
//! waited unread in the sockets behind the admitted scans, so the surplus was not refused as it
//! arrived but queued in front of the admission check, where no bound applies: at 3x offered
//! load the generator saw refusals after 60 to 150 ms and answers after 80 to 500 ms, while the
//! server's own histogram said under 0.25 ms. With the scans here, the runtime reads and refuses
//! first and the scans take the CPU it leaves, so the only queries that wait are the admitted
//! ones, at most the admission bound of them.
//!
//! The threads run at [`NICENESS`] above the process (a tenth of the CPU weight, not the
//! lowest): when refusing takes a whole core, scans still get about a tenth of it instead of
//! nothing. Each job holds an admission permit, so at most the admission bound of jobs wait; the
//! queue is bounded by that and refuses rather than blocks. A job whose caller has gone (the
//! client cancelled, its stay ran out) is dropped without running.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, mpsc};

use tracing::{error, warn};

/// How much nicer than the process the query threads are.
pub const NICENESS: i32 = 10;

type Job = Box<dyn FnOnce() + Send>;

/// Why a job has no answer.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("the query queue is full")]
    Full,
    #[error("the query threads are gone")]
    Stopped,
    #[error("the query panicked")]
    Panicked,
}

/// The query threads. Dropping the pool ends them, each after the job it is running.
pub struct QueryPool {
    jobs: mpsc::SyncSender<Job>,
}

impl QueryPool {
    /// Starts `threads` threads taking jobs in arrival order; at most `queue` jobs wait.
    pub fn start(threads: usize, queue: usize) -> std::io::Result<QueryPool> {
        let (jobs, queued) = mpsc::sync_channel::<Job>(queue);
        let queued = Arc::new(Mutex::new(queued));
        let niceness = (own_niceness() + NICENESS).min(19);
        for i in 0..threads.max(1) {
            let queued = queued.clone();
            std::thread::Builder::new()
                .name(format!("kv-indexer-query-{i}"))
                .spawn(move || {
                    set_niceness(niceness);
                    work(&queued);
                })?;
        }
        Ok(QueryPool { jobs })
    }

    /// Runs `job` on a query thread and returns its answer.
    pub async fn run<T, F>(&self, job: F) -> Result<T, PoolError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            if !answer.is_closed() {
                let _ = answer.send(job());
            }
        });
        self.jobs.try_send(job).map_err(|error| match error {
            mpsc::TrySendError::Full(_) => PoolError::Full,
            mpsc::TrySendError::Disconnected(_) => PoolError::Stopped,
        })?;
        answered.await.map_err(|_| PoolError::Panicked)
    }
}

/// One query thread: runs the next job until the pool is dropped. A panicking job loses its
/// answer (its caller gets [`PoolError::Panicked`]), not the thread.
fn work(queued: &Mutex<mpsc::Receiver<Job>>) {
    loop {
        // Held while waiting, so that the other threads wait for the lock instead: one job
        // goes to one thread.
        let next = match queued.lock() {
            Ok(queued) => queued.recv(),
            Err(_) => return,
        };
        let Ok(job) = next else { return };
        if std::panic::catch_unwind(AssertUnwindSafe(job)).is_err() {
            error!("a query panicked on a query thread");
        }
    }
}

/// The calling thread's nice value (0 where it cannot be read).
fn own_niceness() -> i32 {
    std::fs::read_to_string("/proc/thread-self/stat")
        .ok()
        .and_then(|stat| niceness_in_stat(&stat))
        .unwrap_or(0)
}

/// Field 19 of `/proc/<pid>/stat`; the name in parentheses (field 2) may hold spaces.
fn niceness_in_stat(stat: &str) -> Option<i32> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(16)?.parse().ok()
}

/// Sets the calling thread's nice value (above the process's, which needs no privilege).
fn set_niceness(niceness: i32) {
    let niceness = niceness.clamp(-20, 19);
    // thread_priority's portable scale p in 0..=99 becomes nice floor(39 (1 - p/99)) - 20 on
    // Linux; take the middle of the p that give `niceness`, away from the rounding edges.
    let scale = (99 * (37 - 2 * niceness) / 78).max(0) as u8;
    let priority = thread_priority::ThreadPriorityValue::try_from(scale)
        .map(thread_priority::ThreadPriority::Crossplatform);
    match priority {
        Ok(priority) => {
            if let Err(error) = priority.set_for_current() {
                warn!(?error, niceness, "cannot lower a query thread's priority");
            }
        }
        Err(error) => warn!(?error, niceness, "no such thread priority"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_niceness_after_a_name_with_spaces() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 7 3 0 5";
        assert_eq!(niceness_in_stat(stat), Some(7));
        assert_eq!(niceness_in_stat("42 (x) S"), None);
    }

    #[test]
    fn every_niceness_is_set_exactly() {
        // From the test's own up: a lower one needs a privilege.
        for niceness in own_niceness()..=19 {
            let seen = std::thread::spawn(move || {
                set_niceness(niceness);
                own_niceness()
            })
            .join()
            .unwrap();
            assert_eq!(seen, niceness);
        }
    }

    #[tokio::test]
    async fn query_threads_run_below_the_priority_of_the_process() {
        let pool = QueryPool::start(1, 4).unwrap();
        let seen = pool.run(own_niceness).await.unwrap();
        assert_eq!(seen, (own_niceness() + NICENESS).min(19));
    }

    /// A pool of one thread, held busy until the returned sender sends.
    async fn busy_pool(queue: usize) -> (Arc<QueryPool>, mpsc::Sender<()>) {
        let pool = Arc::new(QueryPool::start(1, queue).unwrap());
        let (release, released) = mpsc::channel::<()>();
        let (started, running) = tokio::sync::oneshot::channel();
        let held = pool.clone();
        tokio::spawn(async move {
            held.run(move || {
                let _ = started.send(());
                let _ = released.recv();
            })
            .await
        });
        running.await.unwrap();
        (pool, release)
    }

    #[tokio::test]
    async fn a_job_whose_caller_left_is_not_run() {
        let (pool, release) = busy_pool(4).await;
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let abandoned = {
            let ran = ran.clone();
            let pool = pool.clone();
            tokio::spawn(async move {
                pool.run(move || ran.store(true, std::sync::atomic::Ordering::SeqCst))
                    .await
            })
        };
        // Queued behind the busy job (the spawned call ran while this yielded), then its
        // caller goes away.
        tokio::task::yield_now().await;
        abandoned.abort();
        let _ = abandoned.await;
        release.send(()).unwrap();
        // One thread, first in first out: this job runs after the abandoned one would have.
        assert_eq!(pool.run(|| 7).await.unwrap(), 7);
        assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[tokio::test]
    async fn refuses_a_job_beyond_the_queue() {
        let (pool, release) = busy_pool(1).await;
        let queued = tokio::spawn({
            let pool = pool.clone();
            async move { pool.run(|| 1).await }
        });
        // One-threaded test runtime: the spawned call has queued its job when this resumes.
        tokio::task::yield_now().await;
        assert!(matches!(pool.run(|| 2).await, Err(PoolError::Full)));
        release.send(()).unwrap();
        assert_eq!(queued.await.unwrap().unwrap(), 1);
    }

    #[tokio::test]
    async fn a_panicking_job_loses_its_answer_not_the_thread() {
        let pool = QueryPool::start(1, 4).unwrap();
        let panicked = pool.run(|| -> u8 { panic!("a bug in a scan") }).await;
        assert!(matches!(panicked, Err(PoolError::Panicked)));
        assert_eq!(pool.run(|| 3).await.unwrap(), 3);
    }
}
